"""Continuous batching: every running sequence advances one token per step, on the model thread.

Shared by the decode and colocated engines; they differ only in how a sequence joins (READY's first token after a
transfer, or a local prefill) and in what ``release`` does with its pages at the end. Each step: drop cancelled
sequences, give each sequence the page its next position needs, run one batched decode (bucketed by
``engine.model.decode``), sample with the request's seed at step = tokens generated so far, stream every token,
and release the sequences that finished.

Out of pages: a sequence that cannot get its next page sits the step out and waits for others to finish; when no
sequence at all can run, the youngest waiting one is stopped with a 503 so the rest make progress (a decode node
cannot recompute a prompt it never prefilled, so there is no retract-and-retry here).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fsm_pd.engine.loader import LoadedModel
from fsm_pd.engine.model_thread import ModelThread
from fsm_pd.engine.pages import OutOfPages, PageAllocator, pages_for
from fsm_pd.engine.sampling import sample
from fsm_pd.serving.forward import chosen_logprobs
from fsm_pd.serving.isolate import run_isolating
from fsm_pd.serving.sequence import Sequence
from fsm_pd.serving.types import EngineError

log = logging.getLogger(__name__)


class DecodeLoop:
    def __init__(
        self,
        model: LoadedModel,
        model_thread: ModelThread,
        allocator: PageAllocator,
        page_size: int,
        release: Callable[[Sequence], None],
    ):
        self.model = model
        self.model_thread = model_thread
        self.allocator = allocator
        self.page_size = page_size
        self.release = release  # returns a finished, failed or cancelled sequence's pages (model thread)
        self.running: list[Sequence] = []
        self.tokens_generated = 0
        self.preempted = 0

    def add(self, seq: Sequence) -> None:
        """Join a sequence whose first token is already emitted; model thread only."""
        self.running.append(seq)

    def end(self, seq: Sequence, error: EngineError | None = None) -> None:
        self.running.remove(seq)
        if error is not None and not seq.cancelled:
            seq.stream.push(error)
        self.release(seq)

    def step(self) -> bool:
        """One decode step for every sequence that can take one; returns True while sequences remain."""
        for seq in [s for s in self.running if s.cancelled]:
            self.end(seq)
        batch = self._with_pages()
        if not batch:
            return bool(self.running)
        for seq, row in zip(batch, run_isolating(batch, self._forward_rows, "decode step"), strict=True):
            if isinstance(row, Exception):  # this sequence fails alone; its neighbours got their tokens
                self.end(seq, EngineError(f"decode step failed: {row}", 500))
                continue
            token, lp = row
            self.tokens_generated += 1
            if seq.emit(token, lp):
                self.end(seq)
        return bool(self.running)

    def _forward_rows(self, batch: list[Sequence]) -> list[tuple[int, float | None]]:
        tokens, logprobs = self._forward(batch)
        return [(int(tokens[i]), float(logprobs[i]) if logprobs is not None and seq.request.return_logprob else None)
                for i, seq in enumerate(batch)]

    def _with_pages(self) -> list[Sequence]:
        ready, stalled = [], []
        for seq in self.running:
            missing = pages_for(seq.next_position + 1, self.page_size) - len(seq.pages)
            if missing > 0:
                try:
                    seq.pages.extend(self.allocator.extend(seq.key, missing))
                except OutOfPages:
                    stalled.append(seq)
                    continue
            ready.append(seq)
        if not ready and stalled:
            youngest = max(stalled, key=lambda s: s.started)
            self.preempted += 1
            self.end(youngest, EngineError("out of KV pages: the request was stopped to let others finish", 503))
        return ready

    def _forward(self, batch: list[Sequence]):
        owner = self.model_thread
        width = max(len(s.pages) for s in batch)
        tables = [s.pages + [0] * (width - len(s.pages)) for s in batch]
        logits, owner.pool = self.model.decode(
            owner.pool, [s.last_token for s in batch], [s.next_position for s in batch], tables
        )
        requests = [s.request for s in batch]
        tokens = sample(
            logits, [r.sampling for r in requests], [r.seed for r in requests], [s.generated for s in batch]
        )
        logprobs = chosen_logprobs(logits, tokens) if any(r.return_logprob for r in requests) else None
        return tokens, logprobs
