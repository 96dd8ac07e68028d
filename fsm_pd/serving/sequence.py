"""One request being generated: its pages, its stop checker, and how its tokens become ``TokenOutput``s.

A ``Sequence`` lives on the model thread only (the scheduler that owns it is the only one to read or change it);
other threads reach it by setting ``cancelled`` through the engine's request table and waiting for the next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fsm_pd.kvpool.prefix_cache import NO_MATCH, Match
from fsm_pd.model.stopping import FinishReason, StopChecker
from fsm_pd.model.tokenizer import Tokenizer
from fsm_pd.serving.types import GenerateRequest, RequestStream, TokenOutput


@dataclass(eq=False)
class Sequence:
    request: GenerateRequest
    stream: RequestStream
    key: int  # its pages' key in the allocator: the room on a decode node, a counter on a colocated one
    prompt_len: int
    pages: list[int]
    checker: StopChecker
    max_context: int
    meta: dict = field(default_factory=dict)  # sent with the last output (prompt_tokens, kv transfer timing, ...)
    # the cached prefix its first pages are (locked while it runs); its KV is not computed again
    prefix: Match = NO_MATCH
    prefilled: int = 0  # prompt tokens whose KV is in its pages: the prefix, then each prefilled chunk
    # a chunked prefill's prompt logprobs (and top rows), gathered chunk by chunk: [None, lp(token 1), ...]
    prompt_logprobs: list | None = None
    prompt_top_logprobs: list | None = None
    cancelled: bool = False  # set by abort() from any thread; the scheduler drops the sequence at its next step
    # True while ``submit`` still opens it (its room, on a PD node): the scheduler takes it from the arrivals only
    # once that is done, so a request whose room was refused never reaches the scheduler's queues
    accepting: bool = False
    started: float = field(default_factory=time.monotonic)
    # when it joined the queue its forward pass is taken from (SGLang's wait queue): at creation, or for a prefill
    # node once its room is bootstrapped; ``take_prefill_batch`` turns it into ``meta["queue_time"]``
    queued_at: float = field(default_factory=time.monotonic)
    prefill_started: float = 0.0  # when its first chunk started (``EngineCore._prefilling``)

    @classmethod
    def start(
        cls,
        request: GenerateRequest,
        stream: RequestStream,
        *,
        key: int,
        pages: list[int],
        tokenizer: Tokenizer,
        eos_token_ids,
        max_context: int,
        meta: dict | None = None,
    ) -> Sequence:
        checker = StopChecker(tokenizer, request.sampling, eos_token_ids, before=request.generated_before)
        return cls(
            request,
            stream,
            key,
            len(request.input_ids),
            list(pages),
            checker,
            max_context,
            # the client's prompt: a migrated stream's earlier tokens are its completion's (``client_tokens``)
            {"prompt_tokens": len(request.input_ids) - len(request.generated_before), **(meta or {})},
        )

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def identity(self) -> tuple[str, int | None]:
        """Its key in the engine's ``RequestTable``: rid and room on a PD node (``GenerateRequest.identity``)."""
        return self.request.identity

    @property
    def generated(self) -> int:
        return len(self.checker.output_ids)

    @property
    def step(self) -> int:
        """The sampling step of the next token: every token the request generated before it, on any node."""
        return len(self.request.generated_before) + self.generated

    @property
    def last_token(self) -> int:
        return self.checker.output_ids[-1]

    @property
    def next_position(self) -> int:
        """Where the last generated token goes in the KV cache (it is fed back in the next decode step)."""
        return self.prompt_len + self.generated - 1

    @property
    def finished(self) -> bool:
        return self.checker.finished or self.prompt_len + self.generated >= self.max_context

    def emit(
        self,
        token_id: int,
        logprob: float | None = None,
        input_token_logprobs: list[float | None] | None = None,
        top_logprobs: list | None = None,
        input_top_logprobs: list | None = None,
    ) -> bool:
        """Record one generated token and stream it; returns True if it was the last one."""
        out, done = self.record(token_id, logprob, input_token_logprobs, top_logprobs, input_top_logprobs)
        self.push(out)
        return done

    def record(
        self,
        token_id: int,
        logprob: float | None = None,
        input_token_logprobs: list[float | None] | None = None,
        top_logprobs: list | None = None,
        input_top_logprobs: list | None = None,
    ) -> tuple[TokenOutput, bool]:
        """Record one generated token: its output (streamed later with ``push``, in order) and whether it was the
        last one."""
        self.checker.append(token_id)
        done = self.finished
        out = TokenOutput(
            int(token_id),
            logprob=None if logprob is None else float(logprob),
            input_token_logprobs=input_token_logprobs,
            top_logprobs=top_logprobs,
            input_top_logprobs=input_top_logprobs,
        )
        if self.generated == 1 and not done:  # a stream's first chunk carries what is known (a PD transfer's timing)
            out.meta = dict(self.meta)
        if done:
            out.finish_reason = finish_reason(self.checker)
            out.text = self.checker.text
            out.meta = {
                **self.meta,
                "completion_tokens": self.step,
                "e2e_seconds": round(time.monotonic() - self.started, 6),
            }
        return out, done

    def push(self, out: TokenOutput) -> None:
        """Stream an output ``record`` made (not once the request is cancelled: nobody reads it)."""
        if not self.cancelled:
            self.stream.push(out)

    def push_many(self, outs: list[TokenOutput]) -> None:
        """Stream several outputs ``record`` made, in order, with one wake-up of the reader."""
        if not self.cancelled:
            self.stream.push_many(outs)

def finish_reason(checker: StopChecker) -> dict:
    """SGLang's finish_reason shape; a sequence that filled the context without a stop is a ``length`` finish."""
    if checker.finish_reason is FinishReason.STOP:
        return {"type": "stop", "matched": checker.matched_stop}
    return {"type": "length"}
