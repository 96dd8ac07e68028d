"""A stub engine that implements the ``Engine`` protocol without a model: for the HTTP layer's tests, the router's
tests, and fuzzing the API (its outputs are scripted, so every route can be exercised in milliseconds).

It behaves like the real engines where the HTTP layer can tell: a prefill node answers one token with
``finish_reason {"type": "length", "length": 0}`` (SGLang's prefill answer) and the prompt's logprobs; a decode or
colocated node generates up to ``max_new_tokens`` tokens (a decode node's first one carries the prompt's logprobs, as
READY brings them from the prefill) of ``reply`` (repeated), stopping at EOS, a stop token id
or a stop string; PD nodes refuse a request without bootstrap fields with ``EngineError(400)``; an abort ends the
stream with ``EngineError(499)``. Live requests are kept in the engines' own ``RequestTable``, so they are keyed by
attempt (rid and room) and an abort that names a room not yet arrived refuses it, as on a real node. Knobs inject
faults: ``submit_error``, ``fail_after``, ``hang``, ``token_delay_s``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from fsm_pd.model.tokenizer import ByteTokenizer
from fsm_pd.serving.request_table import RequestTable
from fsm_pd.serving.types import EngineError, GenerateRequest, RequestStream, TokenOutput

PREFILL_LOGPROB = -1.0  # every logprob a stub prefill reports, so a test can tell whose values it sees
DECODE_LOGPROB = -2.0


def stub_tokenizer() -> ByteTokenizer:
    from fsm_pd.model.tiny import CHATML_TEMPLATE

    return ByteTokenizer(vocab_size=272, chat_template=CHATML_TEMPLATE)


@dataclass(eq=False)
class _Live:
    """A stub request as the ``RequestTable`` holds it; cancelling it sets the event its thread waits on."""

    request: GenerateRequest
    stream: RequestStream
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def identity(self) -> tuple[str, int | None]:
        return self.request.identity

    @property
    def cancelled(self) -> bool:
        return self.stop.is_set()

    @cancelled.setter
    def cancelled(self, value: bool) -> None:
        if value:
            self.stop.set()


@dataclass
class StubEngine:
    role: str = "colocated"
    model_name: str = "stub-model"
    max_context: int = 512
    tokenizer: ByteTokenizer = field(default_factory=stub_tokenizer)
    reply: str = " hello world"
    token_delay_s: float = 0.0
    submit_error: EngineError | None = None  # raised by submit()
    fail_after: int | None = None  # push EngineError(500) after this many tokens
    hang: bool = False  # produce nothing until aborted
    submitted: list[GenerateRequest] = field(default_factory=list)
    refused: list[tuple[GenerateRequest, EngineError]] = field(default_factory=list)  # by the table at submit
    aborted: list[str] = field(default_factory=list)  # the rid of every abort, whether it found a request or not
    aborts: list[tuple[str, int | None]] = field(default_factory=list)  # (rid, room) of every abort
    abort_reasons: list[str | None] = field(default_factory=list)  # the reason of every abort (what a node journals)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = RequestTable()
        self._reply_ids = self.tokenizer.encode(self.reply) or [ord("x")]
        self.submit_seen = threading.Condition(self._lock)

    def submit(self, request: GenerateRequest, stream: RequestStream) -> None:
        if self.submit_error is not None:
            raise self.submit_error
        if self.role in ("prefill", "decode") and request.bootstrap is None:
            raise EngineError(f"request {request.rid}: a {self.role} node needs bootstrap fields", 400)
        if len(request.input_ids) >= self.max_context:
            raise EngineError(f"request {request.rid}: the prompt is longer than the context", 400)
        live = _Live(request, stream)
        try:
            self.requests.add(live)
        except EngineError as err:
            with self._lock:
                self.refused.append((request, err))
            raise
        with self._lock:
            self.submitted.append(request)
            self.submit_seen.notify_all()
        threading.Thread(target=self._produce, args=(request, stream, live.stop), daemon=True,
                         name=f"stub-{request.rid}").start()

    def wait_submitted(self, count: int, timeout_s: float = 5.0) -> bool:
        with self._lock:
            return self.submit_seen.wait_for(lambda: len(self.submitted) >= count, timeout_s)

    def abort(self, rid: str, reason: str | None = None, status: int = 499, *, room: int | None = None) -> bool:
        """As the engines: the table ends the aborted requests' streams with ``EngineError(status)`` and sets their
        threads' stop events."""
        with self._lock:
            self.aborted.append(rid)
            self.aborts.append((rid, room))
            self.abort_reasons.append(reason)
        return bool(self.requests.cancel(rid, room, reason or "aborted", status))

    def info(self) -> dict:
        return {"role": self.role, "model": self.model_name, "running": len(self.requests)}

    def close(self) -> None:
        self.requests.fail_all(EngineError("the stub engine closed: aborted", 499))

    @property
    def live(self) -> list[str]:
        return [live.rid for live in self.requests.live()]

    def _finish(self, request: GenerateRequest) -> None:
        live = self.requests.get(*request.identity)
        if live is not None and live.request is request:
            self.requests.pop(live)

    def _produce(self, request: GenerateRequest, stream: RequestStream, stop: threading.Event) -> None:
        """Runs on the request's own thread; an abort sets ``stop`` (its stream has its error already)."""
        if self.hang:
            stop.wait()
            return
        if self.role == "prefill":
            self._prefill(request, stream, stop)
            return
        sampling = request.sampling
        eos = () if sampling.ignore_eos else self.tokenizer.eos_token_ids
        before = list(request.generated_before)  # a migrated stream goes on where it was, as an engine does
        prompt_tokens = len(request.input_ids) - len(before)
        ids: list[int] = []
        for step in range(sampling.max_new_tokens):
            if stop.wait(self.token_delay_s) if self.token_delay_s else stop.is_set():
                return
            if self.fail_after is not None and step >= self.fail_after:
                self._finish(request)
                stream.push(EngineError("stub engine: injected failure", 500))
                return
            token = self._reply_ids[(len(before) + step) % len(self._reply_ids)]
            ids.append(token)
            finish, text = self._finish_reason(request, before + ids, token, eos)
            if finish is None and step == sampling.max_new_tokens - 1:
                finish = {"type": "length", "length": sampling.max_new_tokens}
                text = self.tokenizer.decode(before + ids)
            if finish is not None:
                self._finish(request)
            out = TokenOutput(token_id=token, logprob=DECODE_LOGPROB if request.return_logprob else None,
                              finish_reason=finish, text=text, meta={"prompt_tokens": prompt_tokens})
            if step == 0 and self.role == "decode" and request.return_logprob:  # the prefill's, carried by READY
                out.input_token_logprobs = [None] + [PREFILL_LOGPROB] * (len(request.input_ids) - 1)
            stream.push(out)
            if finish is not None:
                return

    def _finish_reason(self, request, ids, token, eos) -> tuple[dict | None, str | None]:
        if token in request.sampling.stop_token_ids or token in eos:
            return {"type": "stop", "matched": token}, self.tokenizer.decode(ids[:-1])
        text = self.tokenizer.decode(ids)
        for s in request.sampling.stop:
            if s in text:
                return {"type": "stop", "matched": s}, text[: text.index(s)]
        return None, None

    def _prefill(self, request: GenerateRequest, stream: RequestStream, stop: threading.Event) -> None:
        if stop.wait(self.token_delay_s) if self.token_delay_s else stop.is_set():
            return
        if self.fail_after is not None:
            self._finish(request)
            stream.push(EngineError("stub prefill: injected KV transfer failure", 500))
            return
        self._finish(request)
        logprobs = [None] + [PREFILL_LOGPROB] * (len(request.input_ids) - 1) if request.return_logprob else None
        stream.push(TokenOutput(token_id=self._reply_ids[0],
                                logprob=PREFILL_LOGPROB if request.return_logprob else None,
                                finish_reason={"type": "length", "length": 0}, text="",
                                input_token_logprobs=logprobs, meta={"prompt_tokens": len(request.input_ids)}))


@contextlib.contextmanager
def stub_server(role: str = "colocated", *, bootstrap_port: int | None = None, api_key: str | None = None,
                **knobs) -> Iterator[tuple[str, StubEngine]]:
    """A ``StubEngine`` behind ``create_app`` on 127.0.0.1 (a free port): yields ``(base_url, engine)``."""
    from fsm_pd.api.app import create_app
    from fsm_pd.api.server import AppServer

    engine = StubEngine(role=role, **knobs)
    app = create_app(engine, engine.tokenizer, bootstrap_port=bootstrap_port, api_key=api_key)
    with AppServer(app) as server:
        try:
            yield server.url, engine
        finally:
            engine.close()
