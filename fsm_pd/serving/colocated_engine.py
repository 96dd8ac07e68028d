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

from fsm_pd.model.loader import LoadedModel, load_model
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.model.pages import PageAllocator
from fsm_pd.serving.common import (
    ABORTED_STATUS,
    RequestTable,
    check_request,
    flush_when_idle,
    max_context_for,
    pool_tokens_for,
    refuse_if_unhealthy,
)
from fsm_pd.serving.decode_loop import DecodeLoop
from fsm_pd.serving.forward import prefill_and_sample
from fsm_pd.serving.isolate import run_isolating
from fsm_pd.serving.page_admission import take_prefill_batch
from fsm_pd.serving.retraction import DecodeLoopCollector
from fsm_pd.serving.sequence import Sequence
from fsm_pd.serving.step_driver import StepDriver
from fsm_pd.serving.types import EngineError, GenerateRequest, RequestStream

log = logging.getLogger(__name__)


class ColocatedEngine:
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
        self.model = load_model(model) if isinstance(model, str) else model
        self.model_name = self.model.name
        self.page_size = page_size
        self.layout = self.model.make_kv_layout(num_pages, page_size)
        self.max_context = max_context_for(self.model, num_pages, page_size)
        self.pool_tokens = pool_tokens_for(num_pages, page_size)
        self.max_running, self.max_prefill_batch, self.max_prefill_tokens = (
            max_running,
            max_prefill_batch,
            max_prefill_tokens,
        )
        # enough free pages for every running sequence to cross into one more page
        self.headroom_pages = headroom_pages if headroom_pages is not None else max(1, (num_pages - 1) // 8)
        self.model_thread = ModelThread(self.model.make_pool(self.layout), name="model[colocated]")
        self.allocator = PageAllocator(num_pages)
        self.requests = RequestTable()
        self.loop = DecodeLoop(self.model, self.model_thread, self.allocator, page_size, release=self._release,
                               headroom_pages=self.headroom_pages, max_recompute_batch=max_prefill_batch,
                               max_recompute_tokens=max_prefill_tokens)
        self._waiting: deque[Sequence] = deque()  # appended by submit (any thread), consumed on the model thread
        self._keys = itertools.count(1)
        self._driver = StepDriver(self.model_thread, self._step, name="colocated scheduler")
        self.model_thread.on_death.append(self._cannot_serve)
        self.registries = [CollectorRegistry()]  # /metrics (create_app reads engine.registries)
        self.registries[0].register(DecodeLoopCollector(self.loop.counters, {"role": "colocated", "node": "colocated"}))

    # --- any thread ---
    def submit(self, request: GenerateRequest, stream: RequestStream) -> None:
        refuse_if_unhealthy(self.health())
        check_request(request, self.max_context, needs_bootstrap=False, pool_tokens=self.pool_tokens)
        seq = Sequence.start(
            request,
            stream,
            key=next(self._keys),
            pages=[],
            tokenizer=self.model.tokenizer,
            eos_token_ids=self.model.eos_token_ids,
            max_context=self.max_context,
        )
        self.requests.add(seq)
        self._waiting.append(seq)
        self._driver.kick()

    def abort(self, rid: str, reason: str | None = None, status: int = ABORTED_STATUS) -> bool:
        """Stop the request and free what it holds; False if unknown or finished. ``reason`` (journaled, and in
        the stream's error) and ``status`` default to a client's abort (499); a drain passes its own."""
        found = self.requests.cancel(rid, reason or "aborted", status)
        if found is not None:
            self._driver.kick()
        return found is not None

    def health(self) -> str | None:
        """Why this node cannot serve (its model thread died), or None: ``/health``."""
        return self.model_thread.health()

    def _cannot_serve(self, reason: str) -> None:
        self.requests.fail_all(EngineError(f"this node cannot serve: {reason}", 503))

    def info(self) -> dict:
        return {
            "role": self.role,
            "model": self.model_name,
            "max_context": self.max_context,
            "page_size": self.page_size,
            "pages_free": self.allocator.free_pages,
            "pages_reserved": self.allocator.reserved_pages,
            "requests_live": len(self.requests),
            "requests_waiting": len(self._waiting),
            "requests_running": len(self.loop.running),
            "tokens_generated": self.loop.tokens_generated,
            **self.loop.counters(),
        }

    def flush_cache(self) -> tuple[bool, str]:
        """SGLang's ``/flush_cache`` (see ``common.flush_when_idle``); any thread: runs on the model thread."""
        return self.model_thread.call(lambda _owner: flush_when_idle(self.allocator, len(self.requests)), 30.0)

    def close(self) -> None:
        self._driver.close()
        self.model_thread.close()

    # --- the model thread ---
    def _step(self) -> bool:
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
        self.requests.pop(seq.rid)
