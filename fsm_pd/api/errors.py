"""Errors as HTTP answers: every failure a client caused is a 4xx with a message that says what to fix.

The body is OpenAI's error shape, ``{"error": {"message", "type", "code"}}``; SGLang's ``/generate`` answers
``{"error": {"message"}}``, which this is a superset of, so SGLang clients and the openai package both read it.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fsm_pd.serving.types import EngineError

log = logging.getLogger(__name__)

# Documented on every route that takes a body, so the OpenAPI schema lists what a client can get back.
ERROR_RESPONSES = {
    400: {"description": "bad request: malformed JSON, a field out of range, a prompt too long"},
    401: {"description": "missing or wrong API key"},
    404: {"description": "unknown model"},
    408: {"description": "the request's headers or body did not arrive in time"},
    409: {"description": "the bootstrap_room was already used on this node"},
    500: {"description": "the engine failed"},
    503: {"description": "the engine cannot take the request now"},
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def error_body(status: int, message: str, code: str | None = None, rid: str | None = None) -> dict:
    """``rid``: the failed request's id, ``error.rid`` (what ``fsm-pd replay --request`` takes), when known."""
    try:
        phrase = HTTPStatus(status).phrase.replace(" ", "")
        kind = phrase if phrase.endswith("Error") else phrase + "Error"
    except ValueError:
        kind = "Error"
    error = {"message": message, "type": kind, "code": code or status}
    return {"error": error | {"rid": rid}} if rid is not None else {"error": error}


def error_response(status: int, message: str, code: str | None = None, rid: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, rid), status_code=status)


def with_rid(response: Response, rid: object) -> Response:
    """``response`` with ``rid`` in its error body (``error.rid``) when it is an error answer in JSON that does not
    name its request yet (the router's own, and a worker's it passes on); any other answer as it is."""
    if response.status_code < 400 or not isinstance(rid, str) or isinstance(response, StreamingResponse):
        return response
    try:
        body = json.loads(response.body)
    except (ValueError, TypeError, AttributeError):
        return response
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict) or "rid" in body["error"]:
        return response
    body["error"]["rid"] = rid
    return JSONResponse(body, status_code=response.status_code)


def validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"malformed JSON body{': ' + str(detail) if detail else ''}")
        elif err.get("type") == "missing" and not where:
            parts.append("a JSON body is required")
        elif err.get("type") in ("model_attributes_type", "dict_type") and not where:
            parts.append("the body must be a JSON object (and sent with Content-Type: application/json)")
        else:
            parts.append(f"{where or 'body'}: {err.get('msg', 'invalid')}")
    # A union field reports one error per alternative; the first few say enough.
    unique = list(dict.fromkeys(parts))
    return "; ".join(unique[:4]) + (f" (and {len(unique) - 4} more)" if len(unique) > 4 else "")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code)

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError) -> JSONResponse:
        # the rid of the request that failed, when the route ran one (api/runner.py sets it)
        return error_response(exc.status, str(exc), rid=getattr(request.state, "rid", None))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # 400 rather than FastAPI's 422: what SGLang and OpenAI answer for a request they cannot parse.
        return error_response(400, validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        return response
