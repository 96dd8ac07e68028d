"""The built-in router's routes besides generation: what SGLang's clients call on a router.

* ``POST /abort_request {"rid"}``: forwarded to the prefill and decode worker that hold the request (the router
  remembers which rid went where while it runs: ``RunningRequests``); ``{"abort_all": true}`` goes to every worker.
  Always 200 (as SGLang), ``{"aborted": [...]}`` lists the ids the workers stopped. An unknown rid aborts nothing.
* ``GET|POST /flush_cache``: forwarded to every worker; 200 when all flushed, else the first failure's status (400:
  a worker is busy, 502: unreachable), with each worker's answer under ``workers``.
* ``POST /tokenize``, ``/detokenize`` (and ``/v1/...``), ``GET /v1/models/{id}``: answered by the first admitted
  prefill worker, else decode worker (every worker serves the same model), as ``/model_info`` is.
* ``GET /get_load``: each worker's own ``/get_load``, ``{"prefill": [{"url", "load"}], "decode": [...]}`` (``error``
  instead of ``load`` for a worker that did not answer).
* ``GET /metrics``: the router's own Prometheus metrics (``metrics.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fsm_pd.api.errors import error_response
from fsm_pd.api.schemas import AbortBody
from fsm_pd.api.strict_json import StrictJSONRoute
from fsm_pd.router.metrics import RouterMetrics

FORWARD_TIMEOUT_S = 45.0


class RunningRequests:
    """rid -> the (prefill URL, decode URL) pairs running it now. Touched on the serving loop only."""

    def __init__(self):
        self._where: dict[str, list[tuple[str, str]]] = {}

    def add(self, rid: str, pair: tuple[str, str]) -> Callable[[], None]:
        """Registers ``pair`` for ``rid``; returns the function that forgets it (idempotent)."""
        self._where.setdefault(rid, []).append(pair)
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            pairs = self._where.get(rid, [])
            pairs.remove(pair)
            if not pairs:
                self._where.pop(rid, None)
        return release

    def workers(self, rid: str) -> list[str]:
        return list(dict.fromkeys(url for pair in self._where.get(rid, ()) for url in pair))

    def __len__(self) -> int:
        return len(self._where)


async def released(stream: AsyncIterator[bytes], release: Callable[[], None]) -> AsyncIterator[bytes]:
    """``stream``, forgetting the request once it has ended (or was abandoned)."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        release()


def _passthrough(resp: httpx.Response) -> Response:
    return Response(resp.content, status_code=resp.status_code,
                    media_type=resp.headers.get("content-type", "application/json"))


def install_router_routes(app: FastAPI, pd, metrics: RouterMetrics) -> None:
    """``pd``: the app's ``PDRouter``."""
    headers = {"Authorization": f"Bearer {pd.api_key}"} if pd.api_key else {}

    def all_workers() -> list[tuple[str, str]]:
        return [(w.role, w.url) for w in pd.fleet.all()]

    async def call(method: str, url: str, body: dict | None = None, raw: bytes | None = None) -> httpx.Response | str:
        """The worker's answer, or what went wrong reaching it. ``raw``: a client's body, sent as it came."""
        try:
            if raw is not None:
                return await pd.client.request(method, url, content=raw, timeout=FORWARD_TIMEOUT_S,
                                               headers={**headers, "Content-Type": "application/json"})
            return await pd.client.request(method, url, json=body, headers=headers, timeout=FORWARD_TIMEOUT_S)
        except httpx.HTTPError as err:
            return f"{type(err).__name__}: {err}"

    async def first_prefill(method: str, path: str, raw: bytes | None = None) -> Response:
        worker = pd.fleet.first()
        answer = await call(method, worker.url + path, raw=raw)
        if isinstance(answer, str):
            return error_response(502, f"{worker.role} worker {worker.url} failed: {answer}",
                                  code=f"{worker.role}_unreachable")
        return _passthrough(answer)

    async def abort_request(body: AbortBody) -> dict:
        urls = [url for _, url in all_workers()] if body.abort_all else pd.running.workers(body.rid)
        sent = {"abort_all": True} if body.abort_all else {"rid": body.rid}
        answers = await asyncio.gather(*(call("POST", url + "/abort_request", sent) for url in urls))
        aborted: list[str] = []
        for answer in answers:
            if not isinstance(answer, str) and answer.status_code == 200:
                aborted.extend(answer.json().get("aborted", []))
        return {"aborted": sorted(set(aborted))}

    async def flush_cache() -> Response:
        workers = all_workers()
        answers = await asyncio.gather(*(call("POST", url + "/flush_cache") for _, url in workers))
        report, status = {}, 200
        for (_, url), answer in zip(workers, answers, strict=True):
            if isinstance(answer, str):
                report[url] = {"status": 502, "message": answer}
            else:
                report[url] = {"status": answer.status_code, "message": answer.text.strip()}
            if status == 200 and report[url]["status"] != 200:
                status = report[url]["status"]
        message = "Cache flushed on every worker." if status == 200 else "Not every worker flushed its cache."
        return JSONResponse({"message": message, "workers": report}, status_code=status)

    async def get_load() -> dict:
        workers = all_workers()
        answers = await asyncio.gather(*(call("GET", url + "/get_load") for _, url in workers))
        out: dict[str, list] = {"prefill": [], "decode": []}
        for (side, url), answer in zip(workers, answers, strict=True):
            if isinstance(answer, str):
                out[side].append({"url": url, "error": answer})
            elif answer.status_code != 200:
                out[side].append({"url": url, "error": f"{answer.status_code}: {answer.text.strip()[:200]}"})
            else:
                out[side].append({"url": url, "load": answer.json()})
        return out

    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    app.router.add_api_route("/abort_request", abort_request, methods=["POST"], route_class_override=StrictJSONRoute)
    for method in ("GET", "POST"):  # one route per method: a shared route gives OpenAPI one id twice
        app.add_api_route("/flush_cache", flush_cache, methods=[method], operation_id=f"flush_cache_{method.lower()}")
    app.add_api_route("/get_load", get_load, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    for path in ("/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize"):
        def forwarded(path: str = path):
            async def forward(request: Request) -> Response:  # the worker checks the body
                return await first_prefill("POST", path, await request.body())
            forward.__name__ = "forward_" + path.strip("/").replace("/", "_")
            return forward
        app.add_api_route(path, forwarded(), methods=["POST"])

    async def one_model(model_id: str) -> Response:
        # quoted: an id is client text, and a control character in it must reach the worker as a 404, not break the URL
        return await first_prefill("GET", f"/v1/models/{quote(model_id, safe='')}")

    app.add_api_route("/v1/models/{model_id:path}", one_model, methods=["GET"])
