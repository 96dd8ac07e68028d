"""``DecodeEngine``: receives each request's KV cache from a prefill node, then decodes with continuous batching.

A request goes through:

1. pre-allocation: ``add_receiver`` at once (the manager resolves the prefill node through its bootstrap server
   meanwhile); the request waits in FIFO order until its prompt's pages fit with ``headroom_pages`` to spare, then
   the scheduler reserves them and hands them over with ``give_pages`` (SGLang's ``send_metadata``);
2. transfer: PREPARE, READY, pull and scatter are the manager's; Success or Failed reaches the scheduler through a
   manager observer;
3. decoding: on Success the request joins the running batch with READY's first token (streamed at once) and the
   shared ``DecodeLoop`` takes it from there. At the end ``finish`` frees its pages on the model thread. Under KV
   pressure the loop retracts the newest running requests and later resumes them, recomputing their KV here from
   prompt plus output (``retraction.py``); their rooms stay at Success meanwhile, and no new request is admitted
   while one waits to resume.

When the transfer fails on this node after it reserved the request's pages (a pull or scatter that failed, a
deadline that passed), ``on_transfer_failure`` decides: ``recompute`` (the default) prefills the prompt here, as the
colocated engine does, samples the first token with the request's seed at step 0 and decodes on, so the client gets
the answer an undisturbed run gives (greedy: identical); ``fail`` ends the request with the transfer's error (500).
The room still ends Failed in the journal with its reason; the recompute is logged with the room and request id,
counted (``recomputes``, ``fsm_pd_transfer_recomputes_total``) and named in the answer's ``meta_info.kv_recompute``.
A recomputed request's pages are held under the key ``-(room + 1)``, never a room id, so the failed room's own
``FreePages`` cannot free them. See ``serving.md``.

Why the engine owns the pages (``SchedulerAdmission``) rather than the manager's ``PoolAdmission``: a decoding
sequence grows, one page every ``page_size`` tokens, and those pages must come from the same allocator as the
prompt's, or admission cannot see what decoding will need; and the headroom rule is a scheduling decision.
Freeing stays the machine's job on failure: every failed room's ``FreePages`` calls back ``_on_release``.

Threads: the observer (the manager's loop thread, the owner of rooms) copies what the scheduler needs from a room
that ended (READY's first token and logprobs and the pages at Success, the reason at Failed) into the event it
queues; the model thread reads rooms only through ``manager.poll``. See ``docs/threads.md``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from fsm_pd.control import KVManager
from fsm_pd.control.admission import SchedulerAdmission
from fsm_pd.control.phases import timing_meta
from fsm_pd.model.loader import LoadedModel, load_model
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.model.pages import PageAllocator, pages_for
from fsm_pd.serving.common import (
    ABORTED_STATUS,
    ENDED,
    ROOM_IN_USE_STATUS,
    RequestTable,
    check_request,
    flush_when_idle,
    journal_path,
    max_context_for,
    pool_tokens_for,
    refuse_if_unhealthy,
    room_error_status,
)
from fsm_pd.serving.decode_loop import DecodeLoop
from fsm_pd.serving.forward import input_logprobs_from_wire
from fsm_pd.serving.page_admission import admits
from fsm_pd.serving.recompute import ON_TRANSFER_FAILURE, RECOMPUTED_TRIGGERS, TransferRecompute
from fsm_pd.serving.retraction import DecodeLoopCollector
from fsm_pd.serving.sequence import Sequence
from fsm_pd.serving.step_driver import StepDriver
from fsm_pd.serving.top_logprobs import from_wire as top_logprobs_from_wire
from fsm_pd.serving.types import EngineError, GenerateRequest, RequestStream
from fsm_pd.store import JournalError
from fsm_pd.transport import generate_secret

log = logging.getLogger(__name__)


class DecodeEngine:
    role = "decode"

    def __init__(
        self,
        model: LoadedModel | str = "tiny",
        *,
        num_pages: int = 512,
        page_size: int = 16,
        node_id: str = "decode-0",
        journal: str | None = None,
        secret: bytes | None = None,
        backend: str = "tcp",
        backend_options: dict | None = None,
        deadlines: dict | None = None,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        max_running: int = 64,
        headroom_pages: int | None = None,
        heartbeat: dict | None = None,
        on_transfer_failure: str = "recompute",
    ):
        if on_transfer_failure not in ON_TRANSFER_FAILURE:
            raise ValueError(f"on_transfer_failure must be one of {ON_TRANSFER_FAILURE}, got {on_transfer_failure!r}")
        self.model = load_model(model) if isinstance(model, str) else model
        self.model_name = self.model.name
        self.page_size = page_size
        self.layout = self.model.make_kv_layout(num_pages, page_size)
        self.max_context = max_context_for(self.model, num_pages, page_size)
        self.pool_tokens = pool_tokens_for(num_pages, page_size)
        self.max_running = max_running
        self.headroom_pages = headroom_pages if headroom_pages is not None else max(1, (num_pages - 1) // 8)
        self.secret = secret if secret is not None else generate_secret()
        self.model_thread = ModelThread(self.model.make_pool(self.layout), name=f"model[{node_id}]")
        self.allocator = PageAllocator(num_pages)
        self.requests = RequestTable()
        self.loop = DecodeLoop(self.model, self.model_thread, self.allocator, page_size, release=self._finish,
                               headroom_pages=self.headroom_pages)
        self._rooms: dict[int, Sequence] = {}  # room -> live request not yet decoding (waiting or transferring)
        self._awaiting_pages: deque[Sequence] = deque()
        # (room, Success|Failed, what the scheduler needs of it), queued by the manager's loop thread
        self._events: deque[tuple[int, str, Any]] = deque()
        self._driver = StepDriver(self.model_thread, self._step, name=f"{node_id} scheduler")
        self.manager = KVManager(
            role="decode",
            node_id=node_id,
            layout=self.layout,
            journal=journal_path(journal, node_id),
            secret=self.secret,
            backend=backend,
            backend_options=backend_options,
            deadlines=deadlines,
            host=host,
            advertise_host=advertise_host,  # our side channel's address in PREPARE's reply_to
            admission=SchedulerAdmission(on_release=self._on_release),
            heartbeat=heartbeat,
            model=self.model_thread,
        )
        self.manager.node.observers.append(self._observe)
        self.manager.metrics.watch_leaks(self.leak_counters)
        self.manager.metrics.registry.register(
            DecodeLoopCollector(self.loop.counters, {"role": "decode", "node": node_id}))
        self.recompute = TransferRecompute(self.model, self.model_thread, self.allocator, page_size,
                                           enabled=on_transfer_failure == "recompute",
                                           headroom_pages=self.headroom_pages)
        self.manager.metrics.registry.register(self.recompute.collector({"role": "decode", "node": node_id}))
        # the ABORT of a room we will recompute says so, so the prefill node answers its leg instead of failing it
        self.manager.effects.abort_note = self._abort_note
        self.manager.on_stopped.append(self._cannot_serve)
        self.model_thread.on_death.append(self._cannot_serve)

    # --- any thread ---
    def submit(self, request: GenerateRequest, stream: RequestStream) -> None:
        refuse_if_unhealthy(self.health())
        check_request(request, self.max_context, needs_bootstrap=True, pool_tokens=self.pool_tokens)
        room = request.bootstrap.room
        seq = Sequence.start(
            request,
            stream,
            key=room,
            pages=[],
            tokenizer=self.model.tokenizer,
            eos_token_ids=self.model.eos_token_ids,
            max_context=self.max_context,
        )
        if room in self._rooms:
            raise EngineError(f"request {request.rid}: bootstrap_room {room} is in use by another request",
                              ROOM_IN_USE_STATUS)
        self.requests.add(seq)
        self._rooms[room] = seq
        try:
            self.manager.add_receiver(
                room,
                page_count=pages_for(seq.prompt_len, self.page_size),
                prompt_len=seq.prompt_len,
                rid=request.rid,
                bootstrap_addr=request.bootstrap.addr,
            )
        except (ValueError, JournalError) as exc:  # RoomInUse: used before, maybe before a restart
            self._rooms.pop(room, None)
            self.requests.pop(seq.rid)
            raise EngineError(f"request {request.rid}: {exc}", room_error_status(exc)) from None
        self._awaiting_pages.append(seq)
        self._driver.kick()

    def abort(self, rid: str, reason: str | None = None, status: int = ABORTED_STATUS) -> bool:
        """Stop the request and free what it holds; False if unknown or finished. ``reason`` (journaled, and in
        the stream's error) and ``status`` default to a client's abort (499); a drain passes its own."""
        seq = self.requests.cancel(rid, reason or "aborted", status)
        if seq is None:
            return False
        # In pre-allocation or transfer the machine fails the room and frees its pages. Once decoding the loop
        # drops the sequence at its next step and finishes the room; no abort event then, as one ignored by the
        # Success room could land after the room is cleared and leave a stale state behind (Node.clear races
        # with a step in progress).
        if self._rooms.get(seq.key) is seq:
            self.manager.abort(seq.key, reason or "aborted by the client")
        self._driver.kick()
        return True

    def health(self) -> str | None:
        """Why this node cannot serve (its loop stopped, its model thread died), or None: ``/health``."""
        return self.manager.health()

    def _cannot_serve(self, reason: str) -> None:
        """The loop or the model thread is gone: nothing in flight can finish, so every request ends now."""
        self.requests.fail_all(EngineError(f"this decode node cannot serve: {reason}", 503))

    def info(self) -> dict:
        counters = self.manager.counters()
        return {
            "role": self.role,
            "model": self.model_name,
            "max_context": self.max_context,
            "page_size": self.page_size,
            "pages_free": self.allocator.free_pages,
            "pages_reserved": self.allocator.reserved_pages,
            "requests_live": len(self.requests),
            "prealloc_queue": len(self._awaiting_pages),
            "transfer_queue": len(self._rooms) - len(self._awaiting_pages),
            "requests_running": len(self.loop.running),
            "tokens_generated": self.loop.tokens_generated,
            **self.loop.counters(),
            **self.recompute.counters(),
            **counters,
            "leaks": self.leak_counters(counters),
            "faults": self.manager.effects.faults.config.describe(),
            "faults_injected": self.manager.effects.faults.counters(),
        }

    def leak_counters(self, counters: dict | None = None) -> dict:
        """What this node holds now; when idle: ``pages_free`` at its start value, everything else 0."""
        counters = counters if counters is not None else self.manager.counters()
        return {
            "pages_free": self.allocator.free_pages,
            "pages_reserved": self.allocator.reserved_pages,
            "pulled_awaiting_scatter": counters["pulled_awaiting_scatter"],
            "open_transfer_entries": counters["open_transfer_entries"],
            "rooms_bound_to_peers": counters["rooms_bound_to_peers"],
            "rooms_open": sum(n for s, n in counters["rooms_by_state"].items() if s not in ("Success", "Failed")),
            "requests_live": len(self.requests),
            "queued": len(self._rooms),
            "requests_running": len(self.loop.running),
            "requests_retracted": len(self.loop.retracted),
            "recomputes_waiting": len(self.recompute.waiting),
        }

    def flush_cache(self) -> tuple[bool, str]:
        """SGLang's ``/flush_cache``: on an idle node, put the pool's free pages back in their starting order (there
        is no prefix cache to drop); refused while any request is live. Any thread: runs on the model thread."""
        return self.model_thread.call(lambda _owner: flush_when_idle(self.allocator, len(self.requests)), 30.0)

    def close(self) -> None:
        self._driver.close()
        self.manager.close()
        self.model_thread.close()

    # --- the manager's loop thread ---
    def _abort_note(self, room) -> bool:
        """Whether the ABORT for this failed room says that we recompute it (the same rule as ``_on_room``)."""
        seq = self._rooms.get(room.room)
        return self.recompute.enabled and seq is not None and not seq.cancelled and bool(room.ctx.get("pages"))

    def _observe(self, room, decision, at) -> None:
        if decision.dst != decision.src and decision.dst in ("Success", "Failed"):
            if decision.dst == "Failed":
                # recomputed: a failure this node saw itself (its pull or scatter failed, a deadline passed) once it
                # held pages; a peer's abort or death means the prefill leg failed too, and the router moves on
                detail: Any = {"reason": room.reason, "recompute": decision.trigger in RECOMPUTED_TRIGGERS
                               and bool(room.ctx.get("pages"))}
            else:  # the room is the loop's: copy what the model thread will read
                ctx = room.ctx
                detail = {"pages": list(ctx.get("pages") or ()), "first_token": ctx.get("first_token"),
                          "first_logprob": ctx.get("first_logprob"), "input_logprobs": ctx.get("input_logprobs"),
                          "top_logprobs": ctx.get("top_logprobs"), "ended_at": at,
                          "timing": timing_meta(self.manager.metrics.phases.take(room.room))}
            self._events.append((room.room, decision.dst, detail))
            self._driver.kick()

    # --- the model thread ---
    def _on_release(self, room: int) -> None:
        """The manager frees a room (it failed, or ``finish``): return its pages, admit whoever waits for them."""
        self.allocator.free(room)
        # Nothing reserves for this room after this: admission checks the room is alive on this same thread.
        self.allocator.forget(room)
        self._driver.kick()

    def _step(self) -> bool:
        while self._events:
            self._on_room(*self._events.popleft())
        if not self.loop.resuming:  # retracted requests take the pages first, as for new ones
            self.recompute.prefill(self.max_running - len(self.loop.running), self.loop.add, self._finish)
        self._admit()
        # a recompute whose pages did not fit waits for a page free, which kicks us; with none held it fits now
        return self.loop.step() or (self.recompute.ready_to_run() and not self.loop.resuming)

    def _on_room(self, room: int, state: str, detail: Any) -> None:
        seq = self._rooms.pop(room, None)
        if seq is None:
            if state == "Failed":  # a room no request of ours holds (failed by a restart): nothing else forgets it
                self.manager.clear(room)
            return
        if state == "Failed":
            reason = detail["reason"] or "KV transfer failed"
            self.manager.clear(room)  # its pages: the machine's FreePages calls _on_release
            if not seq.cancelled and self.recompute.enabled and detail["recompute"]:
                self.recompute.start(seq, room, reason)  # the request lives on under a key of its own
                return
            if not seq.cancelled:
                seq.stream.push(EngineError(reason, 500))
            self.requests.pop(seq.rid)
            return
        ctx = detail
        seq.pages = ctx["pages"]
        seq.meta["queue_and_transfer_seconds"] = round(time.monotonic() - seq.started, 6)
        # SGLang's names: this room's phases, and queue_time from the transfer's end to joining the batch (now)
        seq.meta.update(ctx["timing"], queue_time=round(max(0.0, time.time() - ctx["ended_at"]), 6))
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
        if seq.emit(int(ctx["first_token"]), first_logprob, input_logprobs, top, input_top):
            self._finish(seq)
        else:
            self.loop.add(seq)

    def _admit(self) -> None:
        if self.loop.resuming:  # retracted requests take the pages first (SGLang puts them back at the head)
            return
        queue = self._awaiting_pages
        while queue and len(self.loop.running) + len(self._rooms) - len(queue) < self.max_running:
            seq = queue[0]
            state = self.manager.poll(seq.key)  # None until the manager's loop has taken the create event
            if seq.cancelled or self._rooms.get(seq.key) is not seq or state in ENDED:
                queue.popleft()  # it ended while waiting; _on_room answers it
                continue
            need = pages_for(seq.prompt_len, self.page_size)
            if not admits(self.allocator, need, self.headroom_pages):
                return
            queue.popleft()
            try:
                pages = self.allocator.reserve(seq.key, need)
            except ValueError:  # freed already: the room failed while we looked
                continue
            self.manager.give_pages(seq.key, pages)

    def _finish(self, seq: Sequence) -> None:
        """A decoded (or cancelled) request is done: ``finish`` frees its pages after any queued write."""
        self.requests.pop(seq.rid)
        if self.recompute.owns(seq):  # its room was cleared when it failed; its pages are ours
            self.recompute.release(seq)
            return
        self.manager.finish(seq.key)
        self.manager.clear(seq.key)

