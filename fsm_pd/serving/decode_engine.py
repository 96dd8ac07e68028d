"""``DecodeEngine``: receives each request's KV cache from a prefill node, then decodes with continuous batching.

A request goes through:

1. pre-allocation: ``add_receiver`` at once (the manager resolves the prefill node through its bootstrap server
   meanwhile); the request waits in FIFO order until its prompt's pages fit with ``headroom_pages`` to spare, then
   the scheduler reserves them and hands them over with ``give_pages`` (SGLang's ``send_metadata``). Once the
   prefill node's address is known the room waits under its ``admission`` deadline, not its bootstrap deadline; the
   queue shows in ``/health`` (``health_fields``) and ``/metrics`` (``PreallocCollector``);
2. transfer: PREPARE, READY, pull and scatter are the manager's; Success or Failed reaches the scheduler through a
   manager observer;
3. decoding: on Success the request joins the running batch with READY's first token (streamed at once) and the
   shared ``DecodeLoop`` takes it from there. At the end ``finish`` frees its pages on the model thread. Under KV
   pressure the loop retracts the newest running requests and later resumes them, recomputing their KV here from
   prompt plus output (``retraction.py``); their rooms stay at Success meanwhile, and no new request is admitted
   while one waits to resume.

When the transfer fails on this node after it reserved the request's pages (a pull or scatter that failed, a
deadline that passed, the prefill node found dead), ``on_transfer_failure`` decides: ``recompute`` (the default)
prefills the prompt here, as the colocated engine does, samples the first token with the request's seed at step 0
and decodes on, so the client gets the answer an undisturbed run gives (greedy: identical); ``fail`` ends the
request with the transfer's error (500, 502 when the prefill node failed it: ``common.transfer_failure_status``).
The room still ends Failed in the journal with its reason; the recompute is journaled beside it (a ``recompute``
row, ``recompute.py``), logged with the room and request id, counted (``recomputes``,
``fsm_pd_transfer_recomputes_total``) and named in the answer's ``meta_info.kv_recompute``. A recomputed request's
pages are held under the key ``-(room + 1)``, never a room id, so the failed room's own ``FreePages`` cannot free
them. See ``serving.md``.

A request the router sends here whole (``fsm_pd_route`` local: its policy found the prompt not worth a prefill node)
has no room: it joins the recompute's queue and prefill, then the decode loop (``local_path.py``).

Why the engine owns the pages (``SchedulerAdmission``) rather than an admission of the manager's: a decoding sequence
grows, one page every ``page_size`` tokens, and those pages must come from the same allocator as the prompt's, or
admission cannot see what decoding will need; and the headroom rule is a scheduling decision.
Freeing stays the machine's job on failure: every failed room's ``FreePages`` calls back ``_on_release``.

Threads: the observer (the manager's loop thread, the owner of rooms) copies what the scheduler needs from a room
that ended (READY's first token and logprobs and the pages at Success, the reason at Failed) into the event it
queues; the model thread reads rooms only through ``manager.poll``, and owns ``rooms`` (room -> request), the
pre-allocation queue and the running batch. See ``docs/threads.md`` and ``pd_engine.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from fsm_pd.control.admission import SchedulerAdmission
from fsm_pd.control.phases import timing_meta
from fsm_pd.kvpool.pages import pages_for
from fsm_pd.machines.deadlines import explain_failure
from fsm_pd.model.loader import LoadedModel
from fsm_pd.net.unix_sockets import is_unix
from fsm_pd.scheduling.page_admission import CHUNKED_PREFILL_SIZE
from fsm_pd.scheduling.prealloc import Preallocation
from fsm_pd.scheduling.step_budget import DEFAULT_CHUNK_STEPS, StepBudget
from fsm_pd.serving.common import ENDED, transfer_failure_status
from fsm_pd.serving.decode_loop import DecodeLoop
from fsm_pd.serving.device_steps import steps_per_dispatch
from fsm_pd.serving.forward import input_logprobs_from_wire
from fsm_pd.serving.local_path import LocalPath
from fsm_pd.serving.pd_engine import PDEngine
from fsm_pd.serving.recompute import ON_TRANSFER_FAILURE, RECOMPUTED_TRIGGERS, TransferRecompute
from fsm_pd.serving.retraction import DecodeLoopCollector
from fsm_pd.serving.scraped import ScrapedCounters
from fsm_pd.serving.sequence import Sequence
from fsm_pd.serving.top_logprobs import from_wire as top_logprobs_from_wire
from fsm_pd.serving.types import EngineError, GenerateRequest
from fsm_pd.transport.backends.base import PRODUCER_FAILED


class PreallocCollector(ScrapedCounters):
    """``/metrics``: the pre-allocation queue, read at scrape time (``Preallocation.queue``)."""

    def families(self, values: dict, names: list[str], label_values: list[str]) -> Iterator[Metric]:
        for name, key, doc in (
            ("fsm_pd_prealloc_queue", "prealloc_queue", "Requests waiting for free KV pages for their prompt (the "
             "pre-allocation queue; each bounded by its room's admission deadline)"),
            ("fsm_pd_prealloc_oldest_wait_seconds", "prealloc_oldest_wait_s", "How long the oldest request in the "
             "pre-allocation queue has waited"),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=names)
            gauge.add_metric(label_values, float(values[key]))
            yield gauge


class DecodeEngine(LocalPath, PDEngine):
    role = "decode"

    def __init__(self, model: LoadedModel | str = "tiny", *, max_running: int = 64, headroom_pages: int | None = None,
                 heartbeat: dict | None = None, on_transfer_failure: str = "recompute", radix_cache: bool = False,
                 prefill_chunk_steps: float = DEFAULT_CHUNK_STEPS, clock: Callable[[], float] = time.perf_counter,
                 decode_steps_per_dispatch: int | None = None, **node):
        """``node``: the settings of every PD node (``PDEngine``: pool size, node id, journal, secret, backend,
        deadlines, host, advertise_host); ``heartbeat`` overrides the peer watch's timings. ``radix_cache`` (SGLang's
        ``--disaggregation-decode-enable-radix-cache``): keep finished prompts' pages here too, and have the prefill
        node send only the pages of a prompt this node does not already hold. ``prefill_chunk_steps``: while streams
        decode, a prefill here (recompute, local path) costs at most this many decode steps a chunk (0: 512 padded
        tokens a chunk; ``scheduling/step_budget.py``); ``clock`` times the steps for it.
        ``decode_steps_per_dispatch``: decode steps one dispatch may run (``DecodeLoop``; None: by the device)."""
        if on_transfer_failure not in ON_TRANSFER_FAILURE:
            raise ValueError(f"on_transfer_failure must be one of {ON_TRANSFER_FAILURE}, got {on_transfer_failure!r}")
        super().__init__(model, admission=SchedulerAdmission(on_release=self._on_release), heartbeat=heartbeat,
                         prefix_cache=radix_cache, **node)
        self.max_running = max_running
        pages = self.layout.num_pages
        self.headroom_pages = headroom_pages if headroom_pages is not None else max(1, (pages - 1) // 8)
        self.loop = DecodeLoop(self.model, self.model_thread, self.allocator, self.page_size, release=self._finish,
                               headroom_pages=self.headroom_pages, cache=self.cache,
                               steps_per_dispatch=steps_per_dispatch(decode_steps_per_dispatch, self.model_thread.pool),
                               first_token_waiting=self._first_token_waiting, max_running=max_running)
        # the pre-allocation queue, the simulation's too: pages go to a room's transfer when they fit
        self.prealloc = Preallocation(self.allocator, self.page_size, headroom=self.headroom_pages,
                                      grant=self.manager.give_pages, cache=self.cache, kick=self._driver.kick)
        labels = {"role": "decode", "node": self.node_id}
        self.registry.register(DecodeLoopCollector(self.loop.counters, labels))
        self.registry.register(PreallocCollector(lambda: self.prealloc.queue(time.monotonic()), labels))
        # a prompt prefilled here (a recompute, a request sent whole) delays the running streams a chunk at a time;
        # in a shared pool the budget is the prefill engine's too, and it reads from us whether streams run
        shared = node.get("shared")
        self.budget = shared.budget if shared is not None else StepBudget(CHUNKED_PREFILL_SIZE, prefill_chunk_steps)
        if shared is not None:
            shared.decoding = lambda: bool(self.loop.running)
            shared.decode_headroom = self.headroom_pages
            self._driver.react = self.react
        self._shared = shared
        self._clock = clock
        self.recompute = TransferRecompute(self.model, self.model_thread, self.allocator, self.page_size,
                                           enabled=on_transfer_failure == "recompute",
                                           headroom_pages=self.headroom_pages, budget=self.budget, clock=clock)
        self.registry.register(self.recompute.collector(labels))
        self.recompute.record = self.manager.node.record  # each recompute journaled (replay --request shows it)
        self._init_local()  # requests the router sends here whole (fsm_pd_route local: local_path.py)
        # the ABORT of a room we will recompute says so, so the prefill node answers its leg instead of failing it
        self.manager.effects.abort_note = self._abort_note
        self._driver.start()

    def _pool_tokens_checked(self) -> int:
        return self.pool_tokens

    def _check(self, request: GenerateRequest) -> None:
        super()._check(request)
        boot = request.bootstrap
        if self.manager.uds is not None and boot is not None and not boot.local and not is_unix(boot.host):
            raise EngineError(
                f"request {request.rid}: this node serves over unix sockets only (--uds) and opens no TCP socket, but "
                f"bootstrap_host {boot.host!r} names a bootstrap server over TCP; a PD router must name it unix:PATH "
                "(fsm-pd's router: --prefill unix:HTTP_SOCKET unix:BOOTSTRAP_SOCKET; sglang-router cannot name unix "
                "sockets)", 400)

    def _open_room(self, seq: Sequence) -> None:
        route = {"route": seq.request.route["reason"]} if seq.request.route else {}
        self.manager.add_receiver(seq.key, page_count=pages_for(seq.prompt_len, self.page_size),
                                  prompt_len=seq.prompt_len, rid=seq.rid, bootstrap_addr=seq.request.bootstrap.addr,
                                  **route)

    def health_fields(self) -> dict:
        """``/health``'s body while this node serves: its pre-allocation queue (requests waiting for free KV pages,
        and how long the oldest has waited)."""
        return self.prealloc.queue(time.monotonic())

    def _role_info(self) -> dict:
        queue = self.prealloc.queue(time.monotonic())
        return {**queue, "transfer_queue": len(self.rooms) - queue["prealloc_queue"],
                "requests_running": len(self.loop.running), "tokens_generated": self.loop.tokens_generated,
                "prefill_budget": self.budget.state(), **self.loop.counters(), **self.recompute.counters()}

    def _role_leaks(self, counters: dict) -> dict:
        return {"pulled_awaiting_scatter": counters["pulled_awaiting_scatter"],
                "requests_running": len(self.loop.running), "requests_retracted": len(self.loop.retracted),
                "recomputes_waiting": len(self.recompute.waiting) + len(self.recompute.chunking)}

    # --- the manager's loop thread ---
    def _abort_note(self, room) -> bool:
        """Whether the ABORT for this failed room says that we recompute it (the same rule as ``_on_room``): read
        from the room and the thread-safe request table, never from the model thread's ``rooms``."""
        seq = self.requests.get(room.ctx.get("rid"), room.room)
        return self.recompute.enabled and seq is not None and not seq.cancelled and bool(room.ctx.get("pages"))

    def _detail(self, room, decision, at) -> Any:
        if decision.dst == "Failed":
            # recomputed: a failure this node saw itself (its pull or scatter failed, a deadline passed, its prefill
            # node died) once it held pages; a live peer's abort means the prefill leg failed too: the router moves on
            # explained: a deadline that ended the room named with what it waited for (machines/deadlines.py)
            explained = explain_failure("decode", room.reason, room.ctx.get("deadlines"))
            # an entry the prefill node failed: its leg failed too, and a router computes the prompt elsewhere
            own = decision.trigger in RECOMPUTED_TRIGGERS and PRODUCER_FAILED not in (room.reason or "")
            return {"reason": room.reason, "explained": explained, "recompute": own and bool(room.ctx.get("pages"))}
        ctx = room.ctx  # the room is the loop's: copy what the model thread will read
        return {"pages": list(ctx.get("pages") or ()), "first_token": ctx.get("first_token"),
                "first_logprob": ctx.get("first_logprob"), "input_logprobs": ctx.get("input_logprobs"),
                "top_logprobs": ctx.get("top_logprobs"), "ended_at": at,
                "peer": ctx.get("peer"), "bytes": int(ctx.get("bytes") or 0), "sent_pages": ctx.get("page_count"),
                "cached_tokens": int(ctx.get("peer_cached_tokens") or 0),
                "timing": timing_meta(self.manager.metrics.phases.take(room.room))}

    # --- the model thread ---
    def _on_release(self, room: int) -> None:
        """The manager frees a room (it failed, or ``finish``): return its pages, admit whoever waits for them."""
        self.prealloc.release(room)

    def react(self) -> bool:
        """The rooms' events, and nothing more (a shared pool's loop calls it after each pass): a handoff that just
        ended streams its first token now, not after the prefill engine's step. Its rows are committed first, as
        before any first token (``NodeLoop.commit``). True if it took any event."""
        if not self.room_events:
            return False
        self._shared.node_loop.commit()
        events = self._take_room_events()
        for event in events:
            self._on_room(*event)
        return bool(events)

    def _step(self) -> bool:
        self.prealloc.waiting.extend(self._take_local(self._take_arrivals()))
        for event in self._take_room_events():
            self._on_room(*event)
        if not self.loop.resuming:  # retracted requests take the pages first, as for new ones
            self.recompute.prefill(self.max_running - len(self.loop.running), self.loop.add, self._finish,
                                   decoding=bool(self.loop.running))
            in_transfer = len(self.rooms) - len(self.prealloc.waiting) + len(self.recompute.chunking)
            self.prealloc.admit(self.max_running - len(self.loop.running) - in_transfer, self._gone)
        decoding, started = bool(self.loop.running), self._clock()
        running = self.loop.step()
        if decoding and (cost := self.loop.step_cost(self._clock() - started)) is not None:
            self.budget.observe_decode(cost)
        # a recompute whose pages did not fit waits for a page free, which kicks us; with none held it fits now
        return running or (self.recompute.ready_to_run() and not self.loop.resuming)

    def _first_token_waiting(self) -> bool:
        """A transfer under way (its scatter would wait for a long decode dispatch), a recompute or a request sent
        whole under way, or one that waits and has room to start; in a shared pool, a prompt the prefill engine has
        yet to prefill (its chunk runs on the same device right after this engine's dispatch)."""
        in_transfer = len(self.rooms) - len(self.prealloc.waiting)
        room = len(self.loop.running) + in_transfer < self.max_running
        return (in_transfer > 0 or bool(self.recompute.chunking) or bool(self.arrivals)
                or room and (bool(self.prealloc.waiting) or bool(self.recompute.waiting))
                or (self._shared is not None and self._shared.prefill_waiting()))

    def _gone(self, seq: Sequence) -> bool:
        """A request waiting for pages that ended meanwhile (``_on_room`` answers it)."""
        return seq.cancelled or self.rooms.get(seq.key) is not seq or self.manager.poll(seq.key) in ENDED

    def _on_room(self, room: int, state: str, detail: Any) -> None:
        seq = self.rooms.pop(room, None)
        if seq is None:
            if state == "Failed":  # a room no request of ours holds (failed by a restart): nothing else forgets it
                self.manager.clear(room)
            return
        if state == "Failed":
            reason = detail["reason"] or "KV transfer failed"
            self.manager.clear(room)  # its pages: the machine's FreePages calls _on_release
            self.prealloc.failed(seq)  # its cached prefix goes back
            if not seq.cancelled and self.recompute.enabled and detail["recompute"]:
                self.recompute.start(seq, room, reason)  # the request lives on under a key of its own
                return
            if not seq.cancelled:
                seq.stream.push(EngineError(detail["explained"] or reason, transfer_failure_status(reason)))
            self.requests.pop(seq)
            return
        ctx = detail
        seq.pages = ctx["pages"]
        seq.meta["queue_and_transfer_seconds"] = round(time.monotonic() - seq.started, 6)
        # SGLang's names: this room's phases, and queue_time from the transfer's end to joining the batch (now)
        admission = max(0.0, time.time() - ctx["ended_at"])
        seq.meta.update(ctx["timing"], queue_time=round(admission, 6), cached_tokens=ctx["cached_tokens"])
        # the receipt: which prefill node, and what crossed (pages P sent, bytes this node pulled)
        seq.meta["pd_route"] = {"path": "pd", "reason": (seq.request.route or {}).get("reason", ""),
                                "prefill": ctx["peer"], "pages": int(ctx["sent_pages"] or 0), "bytes": ctx["bytes"]}
        if seq.cancelled:
            self._finish(seq)
            return
        input_logprobs = input_logprobs_from_wire(ctx.get("input_logprobs")) if seq.request.return_logprob else None
        first_logprob = ctx.get("first_logprob") if seq.request.return_logprob else None
        try:
            top, input_top = top_logprobs_from_wire(ctx.get("top_logprobs") if seq.request.return_logprob else None)
        except ValueError as err:
            seq.stream.push(EngineError(f"the prefill node's top logprobs are malformed: {err}", 502))
            self._finish(seq)
            return
        self.phases.observe("admission", admission)
        self.phases.observe("first_token", time.monotonic() - seq.started)
        if seq.emit(int(ctx["first_token"]), first_logprob, input_logprobs, top, input_top):
            self._finish(seq)
        else:
            self.loop.add(seq)

    def _finish(self, seq: Sequence) -> None:
        """A decoded (or cancelled) request is done: ``finish`` frees its pages after any queued write."""
        self.requests.pop(seq)
        if self.recompute.owns(seq):  # its room was cleared when it failed (or it never had one); its pages are ours
            self._local_ended(seq)
            return
        # its prompt's pages (the transfer's and our cached prefix) join our cache; FreePages frees the rest
        self.prealloc.finished(seq)
        self.manager.finish(seq.key)
        self.manager.clear(seq.key)
