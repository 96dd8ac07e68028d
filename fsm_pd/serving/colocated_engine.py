"""``ColocatedEngine``: prefill and decode in one process, no transfer; the baseline a PD pair must match.

One scheduler step on the model thread: drop aborted prompts, prefill a batch of waiting prompts that fit (pages
and headroom), stream their first tokens, then one decode step for every running sequence. Under KV pressure the
decode loop retracts the newest running requests and resumes them later (``retraction.py``); no new prompt is
prefilled while one waits to resume.

A prefill step's size: at most ``chunked_prefill_size`` padded tokens, and while streams are decoding at most what
costs ``prefill_chunk_steps`` of their decode steps (``scheduling/step_budget.py``, learnt from the steps this node
times on its ``clock``), so a joining prompt delays the running streams by a few decode steps per chunk rather than
by its whole prefill.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

import jax

from fsm_pd.model.input_buckets import batch_bucket, token_bucket
from fsm_pd.model.loader import LoadedModel
from fsm_pd.scheduling.page_admission import CHUNKED_PREFILL_SIZE, end_prefix, plan_chunks, take_prefill_batch
from fsm_pd.scheduling.step_budget import DEFAULT_CHUNK_STEPS, StepBudget
from fsm_pd.serving.common import check_request
from fsm_pd.serving.decode_loop import DecodeLoop
from fsm_pd.serving.device_steps import steps_per_dispatch
from fsm_pd.serving.engine import EngineCore
from fsm_pd.serving.forward import prefill_step
from fsm_pd.serving.isolate import run_isolating
from fsm_pd.serving.retraction import DecodeLoopCollector
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
        chunked_prefill_size: int = CHUNKED_PREFILL_SIZE,
        headroom_pages: int | None = None,
        radix_cache: bool = True,
        prefill_chunk_steps: float = DEFAULT_CHUNK_STEPS,
        clock: Callable[[], float] = time.perf_counter,
        decode_steps_per_dispatch: int | None = None,
    ):
        """``radix_cache``: reuse cached prompt prefixes (``--disable-radix-cache`` turns it off).
        ``chunked_prefill_size``: padded prompt tokens a step prefills before its decode step; a longer prompt takes
        several steps, so the running streams keep getting tokens (SGLang's chunked prefill).
        ``prefill_chunk_steps``: while streams decode, a prefill step costs at most this many of their decode steps
        (``step_budget.py``; 0: ``chunked_prefill_size`` alone bounds it). ``clock`` times the steps for it.
        ``decode_steps_per_dispatch``: decode steps one dispatch may run (``DecodeLoop``; None: by the device,
        ``device_steps.steps_per_dispatch``)."""
        super().__init__(model, num_pages=num_pages, page_size=page_size, name="colocated", prefix_cache=radix_cache)
        self.max_running, self.max_prefill_batch = max_running, max_prefill_batch
        self.chunked_prefill_size = chunked_prefill_size
        self.budget = StepBudget(chunked_prefill_size, prefill_chunk_steps)
        self._clock = clock
        self.prefill_executor = prefill_step  # the model executor port: runs one step's chunks (forward.py)
        # enough free pages for every running sequence to cross into one more page
        self.headroom_pages = headroom_pages if headroom_pages is not None else max(1, (num_pages - 1) // 8)
        self.loop = DecodeLoop(self.model, self.model_thread, self.allocator, page_size, release=self._release,
                               headroom_pages=self.headroom_pages, max_recompute_batch=max_prefill_batch,
                               max_recompute_tokens=chunked_prefill_size, cache=self.cache,
                               steps_per_dispatch=steps_per_dispatch(decode_steps_per_dispatch, self.model_thread.pool),
                               first_token_waiting=self._first_token_waiting, max_running=max_running)
        self._waiting: deque[Sequence] = deque()  # the model thread's: arrivals waiting for their prefill
        self._chunking: list[Sequence] = []  # pages reserved, prompt partly prefilled: the next chunks go first
        self._keys = itertools.count(1)
        self.registry.register(DecodeLoopCollector(self.loop.counters, {"role": "colocated", "node": "colocated"}))
        self._driver.start()

    def _check(self, request: GenerateRequest) -> None:
        check_request(request, self.max_context, needs_bootstrap=False, pool_tokens=self.pool_tokens)

    def _key(self, request: GenerateRequest) -> int:
        return next(self._keys)

    def info(self) -> dict:
        return {**super().info(), "requests_waiting": len(self._waiting) + len(self.arrivals),
                "requests_prefilling": len(self._chunking),
                "requests_running": len(self.loop.running), "tokens_generated": self.loop.tokens_generated,
                "prefill_steps_cut": self.budget.cut_steps, "prefill_budget": self.budget.state(),
                **self.loop.counters()}

    # --- the model thread ---
    def _step(self) -> bool:
        self._waiting.extend(self._arrived())
        self._prefill()
        decoding = bool(self.loop.running)
        started = self._clock()
        running = self.loop.step()
        if decoding and (cost := self.loop.step_cost(self._clock() - started)) is not None:
            self.budget.observe_decode(cost)
        return (running or bool(self._chunking)
                or bool(self._waiting) and self.allocator.reserved_pages == 0 and not self.loop.resuming)

    def _first_token_waiting(self) -> bool:
        """A prompt under way, or one that arrived and has room to start: it would wait for a long decode dispatch."""
        room = len(self.loop.running) + len(self._chunking) < self.max_running
        return bool(self._chunking) or (room and (bool(self._waiting) or bool(self.arrivals)))

    def _prefill(self) -> None:
        """One chunked-prefill step: the next chunks of prompts under way, then new prompts that fit beside them."""
        for seq in [s for s in self._chunking if s.cancelled]:
            self._chunking.remove(seq)
            self._release(seq)
        budget = self.budget.tokens(decoding=bool(self.loop.running))
        chunks = plan_chunks(self._chunking, max_batch=self.max_prefill_batch, budget=budget)
        room_for = self.max_running - len(self.loop.running) - len(self._chunking)
        if room_for > 0 and self._waiting and not self.loop.resuming:
            admitted = take_prefill_batch(self._waiting, self.allocator, self.page_size,
                                          max_batch=min(room_for, self.max_prefill_batch - len(chunks)),
                                          max_tokens=budget, headroom=self.headroom_pages,
                                          drop=lambda s: s.cancelled, cache=self.cache, planned=chunks)
            self._chunking += admitted
            chunks = plan_chunks(admitted, max_batch=self.max_prefill_batch, budget=budget, planned=chunks)
        if not chunks:
            return
        if budget < self.chunked_prefill_size:
            self.budget.cut_steps += 1
        self._prefilling(chunks)
        started = self._clock()
        firsts = run_isolating(chunks, lambda part: self.prefill_executor(self.model, self.model_thread, part),
                               "prefill")
        # a step whose chunks all leave more to come samples nothing, so nothing waited for its forward pass: wait
        # here, or its cost would be measured as the next decode step's
        with contextlib.suppress(RuntimeError):  # a pool a failed step left deleted: the next step reports it
            jax.block_until_ready(self.model_thread.pool)
        self.budget.observe_prefill(batch_bucket(len(chunks)) * token_bucket(max(c.length for c in chunks)),
                                    self._clock() - started)
        for chunk, first in zip(chunks, firsts, strict=True):
            seq = chunk.seq
            if first is None:  # more chunks to come
                continue
            self._chunking.remove(seq)
            if isinstance(first, Exception):  # fail this request alone, keep serving the others
                seq.stream.push(EngineError(f"prefill failed: {first}", 500))
                self._release(seq)
                continue
            self._prefilled(seq)
            if seq.emit(first.token_id, first.logprob, first.input_logprobs, first.top_logprobs,
                        first.input_top_logprobs):
                self._release(seq)
            else:
                self.loop.add(seq)

    def _release(self, seq: Sequence) -> None:
        # a request that emitted a token was prefilled: its prompt's pages hold its KV and may join the cache
        end_prefix(self.cache, self.allocator, seq, keep=seq.generated > 0)
        self.allocator.forget(seq.key)  # keys are never reused
        self.requests.pop(seq)
