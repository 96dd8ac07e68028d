"""Request bodies parsed as strict JSON: no NaN or Infinity, no lone surrogates, or a 400 that says which.

Python's ``json`` accepts ``NaN``, ``Infinity`` and ``1e999`` (a float that overflows to infinity), none of which
is JSON (RFC 8259 has no such numbers), and it decodes ``"\\ud800"`` to a string no UTF-8 encoder can write back.
Left in, they fail later and far from the request: a tokenizer or an outgoing ``json.dumps`` raises, and the client
gets a 500 (or, batched, its neighbours do). Every route of the nodes and of the router reads its body through
``StrictJSONRoute``, so they are refused at the door with FastAPI's own "malformed JSON body" answer.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute


class _NotStrictJSON(ValueError):
    pass


def _reject_constant(name: str) -> float:
    raise _NotStrictJSON(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotStrictJSON(f"{text} is out of range for a number (it overflows to infinity)")
    return value


def _has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def lone_surrogate_at(value: Any, path: str = "body") -> str | None:
    """Where in a parsed JSON value a string (or object key) holds a lone UTF-16 surrogate; None if nowhere."""
    if isinstance(value, str):
        return path if _has_lone_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _has_lone_surrogate(key):
                return f"{path} (a key)"
            if isinstance(item, str | list | dict) and (found := lone_surrogate_at(item, f"{path}.{key}")):
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, str | list | dict) and (found := lone_surrogate_at(item, f"{path}[{i}]")):
                return found
    return None


def _may_hold_surrogate(body: bytes) -> bool:
    # A lone surrogate arrives as a \uD8xx..\uDFxx escape or as raw non-ASCII bytes (json decodes bodies with
    # 'surrogatepass'); a plain ASCII body without escapes cannot hold one, and most bodies are that.
    return b"\\u" in body or b"\\U" in body or not body.isascii()


def strict_loads(body: bytes | str) -> Any:
    """``json.loads`` that refuses NaN, Infinity and lone surrogates with ``json.JSONDecodeError``."""
    doc = body if isinstance(body, str) else body.decode("utf-8", "replace")
    try:
        value = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError:
        raise
    except ValueError as err:  # ours, an undecodable body, an integer with too many digits
        raise json.JSONDecodeError(str(err), doc, 0) from None
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    if _may_hold_surrogate(raw) and (where := lone_surrogate_at(value)):
        raise json.JSONDecodeError(f"{where} holds a lone surrogate (\\ud800-\\udfff), which is not a character",
                                   doc, 0)
    return value


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = strict_loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """An ``APIRoute`` whose JSON body is read with ``strict_loads`` (FastAPI's documented custom-request hook)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
