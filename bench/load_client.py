"""The load bench's client (``load.py``): streamed chats over a unix socket or TCP, ``streams`` at a time, each timed
from the client's side.

Per request: TTFT is the time from sending it to its first chunk; TPOT is the time from that chunk to the one with
the finish, over the tokens after the first (``usage.completion_tokens`` - 1). The first chunk is the head (the
assistant's role, no text), which fsm-pd sends only once the first token exists (``api/streaming.py``), so it times
the first token even where text is held back: a stream sends no text while it ends in a byte cut mid-character,
which the tiny model's random bytes often do for dozens of tokens (SmolLM2's tokens are whole characters nearly
always). The token counts are the server's own (``stream_options.include_usage``; the prompt's tokens served from the
prefix cache too, ``prompt_tokens_details.cached_tokens``), and the route is the
``x-fsm-pd-route`` header (``pd`` or ``local``: where ``--role pd``'s router sent it). A request is answered (``ok``)
when it got 200, no error event, a finish and its usage.

Each stream has a client (and so a connection) of its own. With one client for all of them, httpx's pool gave every
request that started in the same loop turn the same idle connection (it stays idle until its request starts on it):
all but one failed with ``ConnectionNotAvailable`` and went round again (encode/httpcore#822), a turn of this
loop each. Streams that end together, as equal-length streams do, then sent their next request up to 25 rounds
later: with 64 decode-heavy streams of the tiny model on a 2-core machine (2,048 pages, no retraction) a request
waited 0.5-1 s on average for its connection before a byte went out, all of it counted as TTFT (the client's mean
1,194 ms against the engine's 76); with a client a stream, 1,923 -> 3,521 output tok/s and TTFT p90 3,078 -> 363 ms
(``load.py``, medians of 3 runs each, the same session).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import ssl
import time

import httpx

from fsm_pd.net import unix_http

ROUTE_HEADER = "x-fsm-pd-route"


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One for every client: each would load the CA bundle for its own (httpx's default), several ms of CPU a
    client on the loop that times the streams, twice for a unix socket (the client's and its socket's transport)."""
    return httpx.create_ssl_context()


def client(timeout_s: float) -> httpx.AsyncClient:
    """One stream's client, reaching ``unix:`` URLs (``unix_http.http_url``) and TCP alike: one kept-alive
    connection, which its requests take one after the other (see the module's doc)."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    return unix_http.async_client(timeout=httpx.Timeout(timeout_s, connect=10), limits=limits, verify=_ssl_context())


async def stream_chat(http: httpx.AsyncClient, url: str, kind: str, body: dict) -> dict:
    record = {"kind": kind, "ok": False, "status": 0, "error": "", "route": "", "ttft_s": None, "tpot_s": None,
              "e2e_s": None, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "finish_reason": None}
    sent = time.perf_counter()
    first = last = None
    usage = None
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
            record["status"] = response.status_code
            record["route"] = response.headers.get(ROUTE_HEADER, "")
            if response.status_code != 200:
                record["error"] = (await response.aread()).decode(errors="replace")[:300]
                return record
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record["error"] = json.dumps(event["error"])[:300]
                    continue
                for choice in event.get("choices") or ():
                    first = first if first is not None else now
                    if choice.get("finish_reason"):
                        record["finish_reason"], last = choice["finish_reason"], now
                usage = event.get("usage") or usage
    except httpx.HTTPError as err:
        record["error"] = f"{type(err).__name__}: {err}"[:300]
        return record
    done = time.perf_counter()
    record["e2e_s"] = done - sent
    if usage:
        record["prompt_tokens"] = usage.get("prompt_tokens", 0)
        record["completion_tokens"] = usage.get("completion_tokens", 0)
        record["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if first is not None and last is not None:
        record["ttft_s"] = first - sent
        tokens = record["completion_tokens"]
        record["tpot_s"] = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    record["ok"] = bool(not record["error"] and usage and record["finish_reason"] and first is not None)
    if not record["ok"] and not record["error"]:
        record["error"] = "the stream ended without " + ("its usage" if not usage else "a finish")
    return record


async def _closed_loop(url: str, requests: list[tuple[str, dict]], streams: int, timeout_s: float
                       ) -> tuple[list[dict], float]:
    records: list[dict | None] = [None] * len(requests)
    todo = iter(range(len(requests)))

    async def worker(http: httpx.AsyncClient) -> None:
        for i in todo:  # one iterator shared by the workers: each index goes to exactly one
            kind, body = requests[i]
            records[i] = await stream_chat(http, url, kind, body)

    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(client(timeout_s))
                   for _ in range(max(1, min(streams, len(requests))))]
        started = time.perf_counter()
        await asyncio.gather(*(worker(http) for http in clients))
        seconds = time.perf_counter() - started
    return [r for r in records if r is not None], seconds


def closed_loop(url: str, requests: list[tuple[str, dict]], streams: int, timeout_s: float = 600
                ) -> tuple[list[dict], float]:
    """Send ``requests`` (kind, body) in order, ``streams`` in flight at a time (a new one as soon as one ends);
    the records in the requests' order, and the seconds from the first send to the last end."""
    return asyncio.run(_closed_loop(url, requests, streams, timeout_s))


def whole_chat(url: str, body: dict, timeout_s: float = 600) -> httpx.Response:
    """One chat, not streamed (the prompt probes and the first answer after a start)."""
    with unix_http.client(timeout=httpx.Timeout(timeout_s, connect=10)) as http:
        return http.post(url + "/v1/chat/completions", json=body)
