"""Simulated fsm-pd workers for tests of the built-in router: an ``httpx.MockTransport`` handler that answers
``/health``, ``/abort_request`` and ``/generate`` as prefill, decode and local-serving nodes do on the wire, each
generate call following a scripted fate, and that records every call.

The wire form follows the nodes (``fsm_pd/api/sglang_routes.py``, ``api/streaming.py``, ``api/outputs.py``): a
streamed ``/generate`` answer sends its headers with its first token, then one ``data: {json}`` chunk per token
carrying the whole ``text`` and ``output_ids`` so far and ``meta_info`` (``id``, ``finish_reason``, ``pd_route``,
the receipt), ``fsm_pd_progress`` (the new ids and the seed) when the router asked for it with ``PROGRESS_HEADER``,
and ``data: [DONE]``. An engine error before the first token is an HTTP error status; after it, an error event and
``[DONE]``. A request with ``fsm_pd_resume`` continues from its ids: they open ``output_ids`` and count toward
``max_new_tokens``. A decode leg waits for the KV of its room, which the prefill leg of that room sends.

The "model" is greedy and deterministic: the next token is a function of the prompt and the tokens before it
(``rollout``), so a continuation from the wrong ids gives other tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx

from fsm_pd.api.streaming import PROGRESS_FIELD, PROGRESS_HEADER

# A serve leg (a decode leg of a PD attempt, or a node serving a local attempt whole): what one call does.
#   ("ok",)                answers (after the KV arrived, on a decode leg)
#   ("slow", ms)           answers, ms later
#   ("refuse",)            503 at once, as a draining node refuses new work
#   ("unreachable",)       connection refused
#   ("break", k)           the connection drops after k tokens (before the headers when k is 0)
#   ("eof", k)             the stream ends without [DONE] after k tokens
#   ("abort", k, status)   the engine fails the request after k tokens: an error event (a drain past its bound: 503)
#   ("silent", k)          goes silent after k tokens (before its first one when k is 0) until the router hangs up
#   ("stop", k)            the node stops after k tokens (SIGSTOP, a hung host): from then on it answers nothing,
#                          its health checks time out, and every call it has or gets hangs
# A prefill leg:
#   ("ok",)                sends the KV, answers a moment later (the decode node has acknowledged it by then)
#   ("slow", ms)           sends the KV ms later, and answers at once
#   ("refuse",), ("unreachable",)
#   ("hang",)              never sends the KV nor answers
#   ("kv_then_hang",)      sends the KV, never answers
#   ("kv_then_error",)     sends the KV, then answers 500 (a moment later, as "ok" answers)
#   ("stop",)              the node stops before it sends the KV
SERVE_FAILURES = ("refuse", "unreachable", "break", "eof", "abort", "silent", "stop")
PREFILL_FAILURES = ("refuse", "unreachable", "hang", "kv_then_hang", "kv_then_error", "stop")
BENIGN = ("ok", "slow")
AFTER_K_TOKENS = ("break", "eof", "abort", "silent", "stop")  # the fates that say how many tokens go out first


def next_token(prompt: list[int], before: list[int]) -> int:
    last = before[-1] if before else 0
    return (sum(prompt) * 31 + len(before) * 7919 + last * 13) % 50_000 + 1


def rollout(prompt: list[int], n: int) -> list[int]:
    """The greedy answer of ``n`` tokens."""
    out: list[int] = []
    while len(out) < n:
        out.append(next_token(prompt, out))
    return out


def prompt_logprobs(prompt: list[int]) -> list[list]:
    """``meta_info.input_token_logprobs`` of a prompt, as SGLang gives them: ``[logprob, id, text]``, none for the
    first token."""
    return [[None if i == 0 else -((tid % 7) + 1) / 10, tid, None] for i, tid in enumerate(prompt)]


def text_of(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _error(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": "ServiceUnavailableError", "code": status}}


@dataclass
class Call:
    """One ``/generate`` call a worker got."""

    host: str
    rid: str
    room: int
    side: str  # "prefill" (a PD attempt's prefill leg) or "serve" (its decode leg, or a local attempt)
    path: str  # the router's fsm_pd_route path: "pd" or "local"
    reason: str
    prefill: str | None  # a PD leg's bootstrap host (the prefill node)
    prompt: list[int]
    before: list[int]  # fsm_pd_resume's ids
    resume_seed: int | None
    progress: bool  # the router asked for fsm_pd_progress
    logprob: bool  # return_logprob
    stream: bool
    fate: tuple
    entered: float
    left: float | None = None  # the call ended: answered whole, failed, or its stream closed
    finished: bool = False  # it sent the answer's last token
    sent: int = 0  # tokens it sent (after ``before``)

    @property
    def seed(self) -> int:
        """The seed the node resolves: a resumed stream's, else one derived from the attempt's room."""
        return self.resume_seed if self.resume_seed is not None else self.room % 1_000_003


@dataclass
class Workers:
    """The handler. ``serve_script[rid]`` and ``prefill_script[rid]``: the fates of that request's serve and prefill
    calls, in order (``ok`` past the end). ``unhealthy``: hosts that fail every health check (a node not up).
    ``health_timeout_s``: how long a stopped node's health check takes to time out."""

    serve_script: dict[str, list[tuple]]
    prefill_script: dict[str, list[tuple]]
    unhealthy: frozenset[str] = frozenset()
    health_timeout_s: float = 0.02
    calls: list[Call] = field(default_factory=list)
    stopped: dict[str, float] = field(default_factory=dict)  # host -> when it stopped
    aborts: list[tuple[str, str, int]] = field(default_factory=list)  # (host, rid, room)
    _taken: Counter = field(default_factory=Counter)
    _kv: defaultdict = field(default_factory=lambda: defaultdict(asyncio.Event))

    def _fate(self, rid: str, side: str) -> tuple:
        script = (self.serve_script if side == "serve" else self.prefill_script).get(rid, [])
        k = self._taken[rid, side]
        self._taken[rid, side] += 1
        return script[k] if k < len(script) else ("ok",)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if path == "/health":
            if host in self.unhealthy:
                raise httpx.ConnectError("connection refused (not up)", request=request)
            if host in self.stopped:  # the client's timeout (a mock transport has none)
                await asyncio.sleep(self.health_timeout_s)
                raise httpx.ReadTimeout("timed out", request=request)
            return httpx.Response(200, json={"status": "ok"})
        if path == "/abort_request":
            await self._alive(host)
            body = json.loads(request.content)
            self.aborts.append((host, body["rid"], body["room"]))
            return httpx.Response(200, json={"aborted": []})
        assert path == "/generate", path
        body = json.loads(request.content)
        route = body.get("fsm_pd_route") or {}
        local = route.get("path") == "local"
        side = "prefill" if host.startswith("p") and not local else "serve"
        resume = body.get("fsm_pd_resume") or {}
        call = Call(host, body["rid"], body["bootstrap_room"], side, "local" if local else "pd",
                    route.get("reason", ""), body.get("bootstrap_host"), list(body["input_ids"]),
                    list(resume.get("output_ids") or ()), resume.get("seed"),
                    request.headers.get(PROGRESS_HEADER) == "1", bool(body.get("return_logprob")),
                    bool(body.get("stream")), ("unread",) if host in self.stopped else self._fate(body["rid"], side),
                    asyncio.get_running_loop().time())
        self.calls.append(call)
        try:
            await self._alive(host)  # a stopped node never reads the request (its kernel accepted the connection)
            if side == "prefill":
                response = await self._prefill(request, call, body)
            else:
                response = await self._serve(request, call, body)
        except BaseException:
            self._leave(call)
            raise
        if not isinstance(response.stream, _Events):
            self._leave(call)
        return response

    async def _alive(self, host: str) -> None:
        """Returns only while ``host`` runs: a stopped node never answers."""
        if host in self.stopped:
            await asyncio.Event().wait()

    def _stop(self, host: str) -> None:
        self.stopped.setdefault(host, asyncio.get_running_loop().time())

    def _leave(self, call: Call) -> None:
        if call.left is None:
            call.left = asyncio.get_running_loop().time()

    @staticmethod
    def _turned_away(request: httpx.Request, kind: str) -> httpx.Response | None:
        """The fates that never reach the engine: a node that is not there, and one that is draining."""
        if kind == "unreachable":
            raise httpx.ConnectError("connection refused", request=request)
        if kind == "refuse":
            return httpx.Response(503, json=_error(503, "draining: not taking new requests"))
        return None

    async def _prefill(self, request: httpx.Request, call: Call, body: dict) -> httpx.Response:
        kind = call.fate[0]
        if (away := self._turned_away(request, kind)) is not None:
            return away
        if kind == "stop":
            self._stop(call.host)
        if kind == "hang":
            await asyncio.Event().wait()
        if kind == "slow":  # a queue before the prefill: its answer then follows the transfer at once
            await asyncio.sleep(call.fate[1] / 1000)
        await self._alive(call.host)
        self._kv[call.room].set()  # the KV went to the decode node of this room
        if kind in ("ok", "kv_then_error"):  # the node answers once the decode node acknowledged the transfer
            await asyncio.sleep(0.001)
        await self._alive(call.host)
        if kind == "kv_then_hang":
            await asyncio.Event().wait()
        if kind == "kv_then_error":
            return httpx.Response(500, json=_error(500, "the prefill failed after its transfer"))
        answer = {"text": "", "output_ids": [], "meta_info": {"id": call.rid, "finish_reason": {"type": "length",
                                                                                                "length": 0}}}
        if call.logprob:
            answer["meta_info"].update(input_token_logprobs=prompt_logprobs(call.prompt), output_token_logprobs=[])
        if body.get("stream"):
            return httpx.Response(200, content=_sse(answer) + b"data: [DONE]\n\n",
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=answer)

    async def _serve(self, request: httpx.Request, call: Call, body: dict) -> httpx.Response:
        kind = call.fate[0]
        if (away := self._turned_away(request, kind)) is not None:
            return away
        n = body["sampling_params"]["max_new_tokens"]
        if len(call.before) >= n:
            return httpx.Response(400, json=_error(400, "fsm_pd_resume: nothing is left to generate"))
        if call.path == "pd":
            await self._kv[call.room].wait()  # a decode node's first token comes after the KV
        if kind == "slow":
            await asyncio.sleep(call.fate[1] / 1000)
        await self._alive(call.host)
        k = call.fate[1] if kind in AFTER_K_TOKENS else n  # the tokens it sends
        if kind == "abort":
            k = min(k, n - len(call.before) - 1)  # an engine error comes before the finish
        if k == 0 or not body.get("stream"):
            if kind == "stop":
                self._stop(call.host)
                await self._alive(call.host)
            if kind == "silent":
                await asyncio.Event().wait()
            if kind == "abort":  # before the first token: the engine's error is the answer's status
                return httpx.Response(call.fate[2], json=_error(call.fate[2], "the engine failed the request"))
            if kind in ("break", "eof") and k == 0:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if not body.get("stream"):
            answer = self._chunk(call, n, n - len(call.before))
            if kind in ("break", "eof"):  # the connection drops in the middle of the body
                return httpx.Response(200, stream=_Broken(json.dumps(answer).encode()),
                                      headers={"content-type": "application/json"})
            call.finished, call.sent = True, n - len(call.before)
            return httpx.Response(200, json=answer)
        return httpx.Response(200, stream=_Events(self._events(call, n, k, kind), lambda: self._leave(call)),
                              headers={"content-type": "text/event-stream"})

    def _chunk(self, call: Call, n: int, new: int) -> dict:
        ids = list(call.before)
        while len(ids) < len(call.before) + new:
            ids.append(next_token(call.prompt, ids))
        receipt = ({"path": "local", "reason": call.reason, "prefill": None, "pages": 0, "bytes": 0, "node": call.host}
                   if call.path == "local" else
                   {"path": "pd", "reason": call.reason, "prefill": call.prefill, "pages": 1, "bytes": 4096})
        done = len(ids) >= n
        meta = {"id": call.rid, "finish_reason": {"type": "length", "length": n} if done else None,
                "prompt_tokens": len(call.prompt), "completion_tokens": len(ids), "cached_tokens": 0,
                "pd_route": receipt}
        if call.logprob:
            # a decode node's whole answer leaves the prompt's out (the router puts the prefill's in front); its
            # stream and a node that prefilled the prompt itself give them
            whole_pd = call.path == "pd" and not call.stream
            meta.update(input_token_logprobs=[] if whole_pd else prompt_logprobs(call.prompt),
                        output_token_logprobs=[[-0.25, t, None] for t in ids])
        return {"text": text_of(ids), "output_ids": ids, "meta_info": meta}

    async def _events(self, call: Call, n: int, k: int, kind: str):
        try:
            left = n - len(call.before)
            for i in range(1, left + 1):
                if i > k:
                    break
                await self._alive(call.host)
                chunk = self._chunk(call, n, i)
                if call.progress:
                    chunk[PROGRESS_FIELD] = {"ids": chunk["output_ids"][-1:], "seed": call.seed}
                call.sent, call.finished = i, i == left
                yield _sse(chunk)
            if kind == "stop":
                self._stop(call.host)
            await self._alive(call.host)
            if kind == "silent":
                await asyncio.Event().wait()
            if kind == "break":
                raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
            if kind == "abort":
                yield _sse(_error(call.fate[2], "the request was aborted: the node is draining"))
            if kind != "eof":
                yield b"data: [DONE]\n\n"
        finally:
            self._leave(call)


class _Events(httpx.AsyncByteStream):
    """A streamed answer; closing it (the router hanging up) ends the call, read or not."""

    def __init__(self, events, closed):
        self._events, self._closed = events, closed

    async def __aiter__(self):
        async for chunk in self._events:
            yield chunk

    async def aclose(self) -> None:
        await self._events.aclose()
        self._closed()


class _Broken(httpx.AsyncByteStream):
    """A whole answer whose connection drops halfway through its body."""

    def __init__(self, body: bytes):
        self._half = body[: len(body) // 2]

    async def __aiter__(self):
        yield self._half
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
