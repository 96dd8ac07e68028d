"""Continuous batching: every running sequence advances one token per step, on the model thread.

Shared by the decode and colocated engines; they differ only in how a sequence joins (READY's first token after a
transfer, or a local prefill) and in what ``release`` does with its pages at the end. Each step: drop cancelled
sequences, resume retracted ones whose pages fit (recomputing their KV), give each running sequence the page its
next position needs (retracting the newest when the pool cannot grow them all: ``retraction.py``), run one batched
decode (bucketed by ``engine.model.decode``), sample with the request's seed at step = tokens generated so far,
stream every token, and release the sequences that finished.

Several steps a dispatch (``steps_per_dispatch`` > 1, ``device_steps.py``): while every running sequence samples on
the device, one dispatch runs up to that many steps (sampling and stop tokens on the device, pages reserved ahead
for them), and a step at a time while ``first_token_waiting()`` says a request waits for its first token, so its
prefill never queues behind a long dispatch. A dispatch's tokens are read at the next step, before it dispatches
again, and streamed while the next dispatch runs: the host's streaming overlaps the device's work. A batch with a
sequence that needs the host for a token (logprobs, a grammar, penalties) decodes a step at a time as before.

While any sequence waits to resume, ``resuming`` is True and the engines admit no new request: retracted ones go
first, or new arrivals could take their pages for ever.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from fsm_pd.kvpool.pages import OutOfPages, PageAllocator, pages_for
from fsm_pd.kvpool.prefix_cache import NO_MATCH, PrefixCache
from fsm_pd.model.loader import LoadedModel
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.model.sampling import sample
from fsm_pd.scheduling.page_admission import CHUNKED_PREFILL_SIZE, admits
from fsm_pd.serving.device_steps import Dispatch, dispatch, pages_ahead, samples_on_device
from fsm_pd.serving.forward import fill_kv, top_ks
from fsm_pd.serving.isolate import run_isolating
from fsm_pd.serving.retraction import pick_retractions
from fsm_pd.serving.sequence import Sequence
from fsm_pd.serving.top_logprobs import chosen_and_top
from fsm_pd.serving.types import EngineError, TokenOutput

log = logging.getLogger(__name__)

_ELAPSED = object()  # ``step_cost``: the engine's own measure of the step is the one


class DecodeLoop:
    def __init__(
        self,
        model: LoadedModel,
        model_thread: ModelThread,
        allocator: PageAllocator,
        page_size: int,
        release: Callable[[Sequence], None],
        *,
        headroom_pages: int = 0,
        max_recompute_batch: int = 8,
        max_recompute_tokens: int = CHUNKED_PREFILL_SIZE,
        cache: PrefixCache | None = None,
        steps_per_dispatch: int = 1,
        first_token_waiting: Callable[[], bool] = lambda: False,
        max_running: int = 64,
    ):
        """``steps_per_dispatch``: decode steps one dispatch may run (1: a step at a time, the host sampling each
        token); ``first_token_waiting()``: whether a request waits for its first token (then one step a dispatch);
        ``max_running``: the most sequences the engine runs at once (the dispatches' batch buckets go up to it)."""
        if steps_per_dispatch < 1:
            raise ValueError(f"steps_per_dispatch must be at least 1, got {steps_per_dispatch}")
        self.model = model
        self.model_thread = model_thread
        self.max_running = max_running
        self.allocator = allocator
        self.page_size = page_size
        self.release = release  # returns a finished, failed or cancelled sequence's pages (model thread)
        self.cache = cache  # a retracted sequence lets go of its cached prefix: its pages may be evicted meanwhile
        self.headroom_pages = headroom_pages  # left free when a retracted sequence resumes, for the others to grow
        self.max_recompute_batch, self.max_recompute_tokens = max_recompute_batch, max_recompute_tokens
        self.running: list[Sequence] = []
        self.retracted: list[Sequence] = []  # oldest first: they resume in arrival order
        self.tokens_generated = 0
        # Seconds spent per phase of the decode steps (the model's forward pass, sampling with penalties and
        # grammar masks, output logprobs, emitting: stop checks, detokenizing, streaming): what serving adds to the
        # model's own step is everything but "forward" (bench/token_gap.py prints them per step).
        self.phase_seconds = dict.fromkeys(("forward", "sample", "logprobs", "emit"), 0.0)
        self.steps = 0
        self.steps_per_dispatch = steps_per_dispatch
        self.first_token_waiting = first_token_waiting
        self._pending: Dispatch | None = None  # a dispatch whose tokens the next step reads
        self.dispatches = 0  # of several steps (or one, on the device)
        # (monotonic time its steps were decided, steps asked) of the last dispatches
        self.recent_dispatches: deque[tuple[float, int]] = deque(maxlen=256)
        self._cost: object = _ELAPSED  # what this step measured of a decode step (``step_cost``)
        self.preempted = 0  # retractions
        self.resumed = 0
        self.recomputed_tokens = 0

    @property
    def resuming(self) -> bool:
        """Retracted sequences wait for pages: admit nothing new until they are back."""
        return bool(self.retracted)

    def counters(self) -> dict:
        return {"preempted": self.preempted, "resumed": self.resumed, "recomputed_tokens": self.recomputed_tokens,
                "retracted_waiting": len(self.retracted), "decode_steps": self.steps,
                "decode_dispatches": self.dispatches,
                "decode_phase_seconds": {k: round(v, 6) for k, v in self.phase_seconds.items()}}

    def add(self, seq: Sequence) -> None:
        """Join a sequence whose first token is already emitted; model thread only."""
        self.running.append(seq)

    def end(self, seq: Sequence, error: EngineError | None = None) -> None:
        self.running.remove(seq)
        if error is not None and not seq.cancelled:
            seq.stream.push(error)
        self.release(seq)

    def step(self) -> bool:
        """One decode step (or dispatch of several) for every sequence that can take one; returns True while another
        step can progress."""
        self._cost = _ELAPSED
        outputs = self._collect()
        for seq in [s for s in self.running if s.cancelled]:
            self.end(seq)
        for seq in [s for s in self.retracted if s.cancelled]:
            self.retracted.remove(seq)
            self.release(seq)
        self._resume()
        if self.steps_per_dispatch > 1 and self.running and all(samples_on_device(s) for s in self.running):
            decided = time.monotonic()
            waiting = self.first_token_waiting()  # its prefill would queue behind the dispatch: one step
            steps = 1 if waiting else self.steps_per_dispatch
            batch = self._with_pages(steps)
            started = time.perf_counter()
            try:
                on_device = bool(batch) and self._dispatch(batch, steps, decided)
            finally:
                self._push(outputs)  # the last dispatch's tokens stream while this one runs
            if on_device and not waiting:
                if self._cost is _ELAPSED:  # this call only started a dispatch: its cost is read with its tokens
                    self._cost = None
                return True  # the next step reads its tokens
            if on_device:  # read at once: the step is whole, and the prefill after it waits for nothing more
                self._push(self._collect())
                self._cost = time.perf_counter() - started
                return bool(self.running) or (bool(self.retracted) and self.allocator.reserved_pages == 0)
        else:
            self._push(outputs)
            batch = self._with_pages()
        self._step_on_host(batch)
        # Nothing could run: the oldest waits for pages held outside the batch (transfers), and whoever frees them
        # kicks the scheduler, so no step is queued until then. With an empty pool a retracted sequence resumes at
        # the next step.
        return (bool(batch) and bool(self.running)) or (bool(self.retracted) and self.allocator.reserved_pages == 0)

    def step_cost(self, elapsed: float) -> float | None:
        """What the last ``step`` says a decode step costs, for the prefill budget (``step_budget.py``): ``elapsed``
        (the caller's clock around it) when it ran one step from start to end on the host; when it read a dispatch's
        tokens, that dispatch's time from its start, if it ran one step (None if it read none, read them late: they
        had been waiting, or the dispatch ran several steps: a prefill step never runs beside those)."""
        return elapsed if self._cost is _ELAPSED else self._cost

    def _step_on_host(self, batch: list[Sequence]) -> None:
        """One step, the host sampling every token (logprobs, grammars, penalties)."""
        rows = run_isolating(batch, self._forward_rows, "decode step") if batch else []
        emitting = time.perf_counter()
        for seq, row in zip(batch, rows, strict=True):
            if isinstance(row, Exception):  # this sequence fails alone; its neighbours got their tokens
                self.end(seq, EngineError(f"decode step failed: {row}", 500))
                continue
            token, lp, top = row
            self.tokens_generated += 1
            if seq.emit(token, lp, top_logprobs=top):
                self.end(seq)
        if batch:
            self.steps += 1
            self.phase_seconds["emit"] += time.perf_counter() - emitting

    def _dispatch(self, batch: list[Sequence], steps: int, decided: float) -> bool:
        """Start a dispatch of up to ``steps`` steps; False when it cannot run on the device (its program is not
        compiled yet, or it failed to start): the batch then takes a step on the host."""
        started = time.perf_counter()
        try:
            pending = dispatch(self.model, self.model_thread, batch, steps, self.steps_per_dispatch, self.page_size,
                               self.max_running)
        except Exception:  # the host step runs each request alone if the batch fails again there
            log.exception("a dispatch of %d decode steps for %d requests failed to start; one step on the host",
                          steps, len(batch))
            return False
        if pending is None:
            return False
        self._pending = pending
        self.dispatches += 1
        self.recent_dispatches.append((decided, steps))
        self.phase_seconds["forward"] += time.perf_counter() - started
        return True

    def _collect(self) -> list[tuple[Sequence, TokenOutput]]:
        """The tokens of the dispatch in flight, recorded on their sequences (the finished ones end: their pages go
        back before the next dispatch); returned to stream, in order."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        began, late = time.perf_counter(), pending.ready()
        try:
            tokens = pending.wait()
        except Exception as exc:  # noqa: BLE001 - the device failed the dispatch: its requests fail, the loop goes on
            log.exception("a dispatch of %d decode steps failed", pending.steps)
            for seq in pending.rows:
                if seq in self.running:
                    self.end(seq, EngineError(f"decode step failed: {exc}", 500))
            return []
        now = time.perf_counter()
        self.phase_seconds["forward"] += now - began
        ran = int((tokens >= 0).sum(axis=1).max(initial=0))
        self.steps += ran
        # A dispatch of several steps says nothing of what a step beside a prefill costs: that step is always one a
        # dispatch (a waiting prompt makes it so), and its fixed cost is the host's, which a dispatch of 8 shares out.
        # Counted, it cut every prefill to 4 of its per-token 0.9 ms on a TPU v5e (docs/tpu.md, round r11).
        self._cost = None if late or not ran or pending.steps > 1 else now - pending.dispatched_at
        outputs: list[tuple[Sequence, TokenOutput]] = []
        live = set(self.running)
        for seq, row in zip(pending.rows, tokens.tolist(), strict=True):
            if seq not in live or seq.cancelled:
                continue
            for token in row:
                if token < 0:
                    break
                out, done = seq.record(token)
                outputs.append((seq, out))
                self.tokens_generated += 1
                if done:  # what the device made after a stop string the host found is dropped
                    self.end(seq)
                    break
        self.phase_seconds["emit"] += time.perf_counter() - now
        return outputs

    def _push(self, outputs: list[tuple[Sequence, TokenOutput]]) -> None:
        """Stream a dispatch's outputs: each request's tokens in one push (they come in order, a request's
        together), so the event loop wakes once a request, not once a token."""
        started = time.perf_counter()
        at = 0
        while at < len(outputs):
            seq, end = outputs[at][0], at + 1
            while end < len(outputs) and outputs[end][0] is seq:
                end += 1
            seq.push_many([out for _, out in outputs[at:end]])
            at = end
        if outputs:
            self.phase_seconds["emit"] += time.perf_counter() - started

    def _forward_rows(self, batch: list[Sequence]) -> list[tuple[int, float | None, list | None]]:
        tokens, logprobs, tops = self._forward(batch)
        want = logprobs is not None
        return [(int(tokens[i]), float(logprobs[i]) if want and seq.request.return_logprob else None,
                 tops[i] if want else None) for i, seq in enumerate(batch)]

    def _missing(self, seq: Sequence, steps: int = 1) -> int:
        return max(0, pages_ahead(seq, steps, self.page_size) - len(seq.pages))

    def _with_pages(self, steps: int = 1) -> list[Sequence]:
        """The running sequences that hold the page their next step writes, after growing them (retracting the
        newest when the pool cannot grow them all). For a dispatch of ``steps`` steps each is first grown for all
        of them, where the pool has that to spare beyond the headroom; else by one page, and a row stops where its
        pages end."""
        if steps > 1:
            ahead = [(seq, self._missing(seq, steps)) for seq in self.running]
            if sum(missing for _, missing in ahead) <= self.allocator.free_pages - self.headroom_pages:
                for seq, missing in ahead:
                    if missing > 0:
                        try:
                            seq.pages.extend(self.allocator.extend(seq.key, missing))
                        except OutOfPages:  # pages held outside the batch: one page, as below
                            break
        by_age = sorted(self.running, key=lambda s: s.started)
        demands = [(seq, len(seq.pages), self._missing(seq)) for seq in by_age]
        for seq in pick_retractions(demands, self.allocator.free_pages):
            self._retract(seq)
        ready = []
        for seq in self.running:
            missing = self._missing(seq)
            if missing > 0:
                try:
                    seq.pages.extend(self.allocator.extend(seq.key, missing))
                except OutOfPages:  # only the oldest, while pages are held outside the batch: it waits a step
                    continue
            ready.append(seq)
        return ready

    def _retract(self, seq: Sequence) -> None:
        """Give every page of ``seq`` back and queue it to resume; its tokens and stream stay as they are."""
        self.running.remove(seq)
        if self.cache is not None:
            self.cache.unlock(seq.prefix)
            seq.prefix = NO_MATCH
        given = self.allocator.give_back(seq.key)
        seq.pages = []
        self.retracted.append(seq)
        self.retracted.sort(key=lambda s: s.started)
        self.preempted += 1
        log.info("retracted request %s (%d pages, %d tokens generated) under KV pressure; %d free",
                 seq.rid, given, seq.generated, self.allocator.free_pages)

    def _resume(self) -> None:
        """Resume the oldest retracted sequences whose pages fit with headroom to spare; one batched recompute."""
        batch: list[Sequence] = []
        while self.retracted and len(batch) < self.max_recompute_batch:
            seq = self.retracted[0]
            need = pages_for(seq.next_position + 1, self.page_size)
            if not admits(self.allocator, need, self.headroom_pages):
                break
            try:
                seq.pages = self.allocator.extend(seq.key, need)
            except OutOfPages:
                break
            self.retracted.pop(0)
            batch.append(seq)
        if not batch:
            return
        for seq, result in zip(batch, run_isolating(batch, self._recompute, "recompute"), strict=True):
            if isinstance(result, Exception):
                self.running.append(seq)  # end() takes it from the running list
                self.end(seq, EngineError(f"recomputing the KV of a retracted request failed: {result}", 500))
                continue
            self.running.append(seq)
            self.resumed += 1
            self.recomputed_tokens += seq.next_position

    def _recompute(self, batch: list[Sequence]) -> list[None]:
        """Write the KV of every position before ``next_position`` (prompt, then all generated tokens but the
        last, which the next decode step feeds in), in chunks of the prefill budget; the logits are not needed, the
        next token is."""
        fill_kv(self.model, self.model_thread, [(list(s.request.input_ids) + s.checker.output_ids[:-1], s.pages)
                                                for s in batch],
                budget=self.max_recompute_tokens, max_batch=self.max_recompute_batch)
        return [None] * len(batch)

    def _forward(self, batch: list[Sequence]):
        owner = self.model_thread
        started = time.perf_counter()
        width = max(len(s.pages) for s in batch)
        tables = [s.pages + [0] * (width - len(s.pages)) for s in batch]
        logits, owner.pool = self.model.decode(  # the bucket's rows: no program per batch size (model/decoder.py)
            owner.pool, [s.last_token for s in batch], [s.next_position for s in batch], tables, bucket_rows=True
        )
        logits.block_until_ready()
        sampling = time.perf_counter()
        requests = [s.request for s in batch]
        tokens = sample(
            logits, [r.sampling for r in requests], [r.seed for r in requests], [s.step for s in batch],
            histories=[s.checker.history for s in batch],  # penalties count every output token, the first too
            grammars=[s.checker.grammar for s in batch],  # structured output: each parser has seen every token
        )
        sampled = time.perf_counter()
        self.phase_seconds["forward"] += sampling - started
        self.phase_seconds["sample"] += sampled - sampling
        if not any(r.return_logprob for r in requests):
            return tokens, None, None
        logprobs, tops = chosen_and_top(np.asarray(logits)[: len(batch)], tokens, top_ks(requests))
        self.phase_seconds["logprobs"] += time.perf_counter() - sampled
        return tokens, logprobs, tops
