"""A stub engine that implements the ``Engine`` protocol without a model: for the HTTP layer's tests, the router's
tests, and fuzzing the API (its outputs are scripted, so every route can be exercised in milliseconds).

It behaves like the real engines where the HTTP layer can tell: a prefill node answers one token with
``finish_reason {"type": "length", "length": 0}`` (SGLang's prefill answer) and the prompt's logprobs; a decode or
colocated node generates up to ``max_new_tokens`` tokens (a decode node's first one carries the prompt's logprobs, as
READY brings them from the prefill) of ``reply`` (repeated), stopping at EOS, a stop token id
or a stop string; PD nodes refuse a request without bootstrap fields with ``EngineError(400)``; an abort ends the
stream with ``EngineError(499)``. Knobs inject faults: ``submit_error``, ``fail_after``, ``hang``, ``token_delay_s``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from fsm_pd.model.tokenizer import ByteTokenizer
from fsm_pd.serving.types import EngineError, GenerateRequest, RequestStream, TokenOutput

PREFILL_LOGPROB = -1.0  # every logprob a stub prefill reports, so a test can tell whose values it sees
DECODE_LOGPROB = -2.0


def stub_tokenizer() -> ByteTokenizer:
    from fsm_pd.model.tiny import CHATML_TEMPLATE

    return ByteTokenizer(vocab_size=272, chat_template=CHATML_TEMPLATE)


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
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, threading.Event] = {}
        self._abort_reasons: dict[str, tuple[str, int]] = {}  # rid -> what its stream ends with, as the engines do
        self._reply_ids = self.tokenizer.encode(self.reply) or [ord("x")]
        self.submit_seen = threading.Condition(self._lock)

    def submit(self, request: GenerateRequest, stream: RequestStream) -> None:
        if self.submit_error is not None:
            raise self.submit_error
        if self.role in ("prefill", "decode") and request.bootstrap is None:
            raise EngineError(f"request {request.rid}: a {self.role} node needs bootstrap fields", 400)
        if len(request.input_ids) >= self.max_context:
            raise EngineError(f"request {request.rid}: the prompt is longer than the context", 400)
        stop = threading.Event()
        with self._lock:
            if request.rid in self._live:
                raise EngineError(f"request {request.rid} is already running", 400)
            self._live[request.rid] = stop
            self.submitted.append(request)
            self.submit_seen.notify_all()
        threading.Thread(target=self._produce, args=(request, stream, stop), daemon=True,
                         name=f"stub-{request.rid}").start()

    def wait_submitted(self, count: int, timeout_s: float = 5.0) -> bool:
        with self._lock:
            return self.submit_seen.wait_for(lambda: len(self.submitted) >= count, timeout_s)

    def abort(self, rid: str, reason: str | None = None, status: int = 499) -> bool:
        with self._lock:
            stop = self._live.pop(rid, None)
            self.aborted.append(rid)
            if stop is not None:
                self._abort_reasons[rid] = (reason or "aborted", status)
        if stop is None:
            return False
        stop.set()
        return True

    def info(self) -> dict:
        with self._lock:
            return {"role": self.role, "model": self.model_name, "running": len(self._live)}

    def close(self) -> None:
        with self._lock:
            stops, self._live = list(self._live.values()), {}
        for stop in stops:
            stop.set()

    @property
    def live(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def _aborted(self, rid: str) -> EngineError:
        with self._lock:
            reason, status = self._abort_reasons.pop(rid, ("aborted", 499))
        return EngineError(f"request {rid} {reason}", status)

    def _finish(self, rid: str) -> None:
        with self._lock:
            self._live.pop(rid, None)

    def _produce(self, request: GenerateRequest, stream: RequestStream, stop: threading.Event) -> None:
        if self.hang:
            stop.wait()
            stream.push(self._aborted(request.rid))
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
                stream.push(self._aborted(request.rid))
                return
            if self.fail_after is not None and step >= self.fail_after:
                self._finish(request.rid)
                stream.push(EngineError("stub engine: injected failure", 500))
                return
            token = self._reply_ids[(len(before) + step) % len(self._reply_ids)]
            ids.append(token)
            finish, text = self._finish_reason(request, before + ids, token, eos)
            if finish is None and step == sampling.max_new_tokens - 1:
                finish = {"type": "length", "length": sampling.max_new_tokens}
                text = self.tokenizer.decode(before + ids)
            if finish is not None:
                self._finish(request.rid)
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
            stream.push(EngineError(f"request {request.rid} aborted", 499))
            return
        if self.fail_after is not None:
            self._finish(request.rid)
            stream.push(EngineError("stub prefill: injected KV transfer failure", 500))
            return
        self._finish(request.rid)
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
