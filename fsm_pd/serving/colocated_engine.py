"""``ColocatedEngine``: prefill and decode in one process, no transfer; the baseline a PD pair must match.

One scheduler step on the model thread: drop aborted prompts, prefill a batch of waiting prompts that fit (pages
and headroom), stream their first tokens, then one decode step for every running sequence. Under KV pressure the
decode loop retracts the newest running requests and resumes them later (``retraction.py``); no new prompt is
prefilled while one waits to resume.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque

from prometheus_client import CollectorRegistry

from fsm_pd.model.loader import LoadedModel
from fsm_pd.serving.common import check_request
from fsm_pd.serving.decode_loop import DecodeLoop
from fsm_pd.serving.engine import EngineCore
from fsm_pd.serving.forward import prefill_and_sample
from fsm_pd.serving.isolate import run_isolating
from fsm_pd.serving.retraction import DecodeLoopCollector
from fsm_pd.serving.scheduling import take_prefill_batch
from fsm_pd.serving.sequence import Sequence
from fsm_pd.serving.types import EngineError, GenerateRequest

log = logging.getLogger(__name__)


class ColocatedEngine(EngineCore):
    role = "colocated"

    def __init__(
        self,
        model: LoadedModel | str = "tiny",
        *,
        num_pages: int = 512,
        page_size: int = 16,
        max_running: int = 64,
        max_prefill_batch: int = 8,
        max_prefill_tokens: int = 4096,
        headroom_pages: int | None = None,
    ):
        super().__init__(model, num_pages=num_pages, page_size=page_size, name="colocated")
        self.max_running, self.max_prefill_batch, self.max_prefill_tokens = (
            max_running,
            max_prefill_batch,
            max_prefill_tokens,
        )
        # enough free pages for every running sequence to cross into one more page
        self.headroom_pages = headroom_pages if headroom_pages is not None else max(1, (num_pages - 1) // 8)
        self.loop = DecodeLoop(self.model, self.model_thread, self.allocator, page_size, release=self._release,
                               headroom_pages=self.headroom_pages, max_recompute_batch=max_prefill_batch,
                               max_recompute_tokens=max_prefill_tokens)
        self._waiting: deque[Sequence] = deque()  # the model thread's: arrivals waiting for their prefill
        self._keys = itertools.count(1)
        self.registries = [CollectorRegistry()]  # /metrics (create_app reads engine.registries)
        self.registries[0].register(DecodeLoopCollector(self.loop.counters, {"role": "colocated", "node": "colocated"}))
        self._driver.start()

    def _check(self, request: GenerateRequest) -> None:
        check_request(request, self.max_context, needs_bootstrap=False, pool_tokens=self.pool_tokens)

    def _key(self, request: GenerateRequest) -> int:
        return next(self._keys)

    def info(self) -> dict:
        return {**super().info(), "requests_waiting": len(self._waiting) + len(self.arrivals),
                "requests_running": len(self.loop.running), "tokens_generated": self.loop.tokens_generated,
                **self.loop.counters()}

    # --- the model thread ---
    def _step(self) -> bool:
        self._waiting.extend(self._arrived())
        self._prefill()
        running = self.loop.step()
        return running or bool(self._waiting) and self.allocator.reserved_pages == 0 and not self.loop.resuming

    def _prefill(self) -> None:
        room_for = self.max_running - len(self.loop.running)
        if room_for <= 0 or not self._waiting or self.loop.resuming:
            return
        batch = take_prefill_batch(
            self._waiting,
            self.allocator,
            self.page_size,
            max_batch=min(room_for, self.max_prefill_batch),
            max_tokens=self.max_prefill_tokens,
            headroom=self.headroom_pages,
            drop=lambda s: s.cancelled,
        )
        if not batch:
            return
        firsts = run_isolating(batch, lambda seqs: prefill_and_sample(
            self.model, self.model_thread, [s.request for s in seqs], [s.pages for s in seqs]), "prefill")
        for seq, first in zip(batch, firsts, strict=True):
            if isinstance(first, Exception):  # fail this request alone, keep serving the others
                seq.stream.push(EngineError(f"prefill failed: {first}", 500))
                self._release(seq)
            elif seq.emit(first.token_id, first.logprob, first.input_logprobs, first.top_logprobs,
                          first.input_top_logprobs):
                self._release(seq)
            else:
                self.loop.add(seq)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.key)
        self.allocator.forget(seq.key)  # keys are never reused
        self.requests.pop(seq)
