"""``PrefillEngine``: runs prompts and hands their KV cache to a decode node through the KV manager.

A request goes through three queues, as in SGLang's prefill node:

1. bootstrap: ``add_sender`` at once; the request waits until the decode node's PREPARE arrives (the sender room
   reaches WaitingForInput), so prefill work is only spent on requests a decode node has pages for (on one pool
   with the decode engine, ``--role pd``, its prompt is prefilled meanwhile and only its handoff waits:
   ``early_prefill.py``);
2. prefill: on the model thread, in batches of prompts that fit the free pages; the first token is sampled with
   the request's seed at step 0 (``max_new_tokens`` is 1 here) and handed over with ``kv_ready``;
   A prompt of several chunks starts its handoff after its first chunk (``kv_first_chunk``: READY goes out) and
   reports every later one (``kv_chunk``), so each chunk's pages travel while the next one computes and only the
   last piece and the first token are left after the last chunk (``effects/chunked.py``). A request that asked for
   logprobs is handed over whole after its last chunk: READY carries them.
3. in flight: the manager gathers and publishes the pages and waits for PULLED. The request is answered once its
   room reaches Success (one ``TokenOutput``, finish_reason length) or Failed (``EngineError(reason, 500)``); either
   way its pages are freed then, on the model thread, after the gather that read them. One exception: when the
   decode node's ABORT says it recomputes the request itself (``RECOMPUTE_NOTE``, its ``--on-transfer-failure
   recompute``), the room still ends Failed but the request is answered as at Success, with the failure in
   ``meta_info.kv_transfer_failed``: the client's answer comes from the decode node, which a router would
   otherwise throw away for this leg's error.

Room transitions reach the scheduler through a manager observer (the manager's loop thread), which only queues
them (with the failure reason, read there) and kicks the model thread: every scheduling decision is taken on the
model thread, which reads rooms only through ``manager.poll`` (the published states) and changes them only through
the manager's calls (``kv_ready``, ``fail``, ``abort``, ``clear``); see ``docs/threads.md``.

With ``serve_local`` (``--serve-local``) the node serves both roles: a request the router sends here whole
(``fsm_pd_route`` local) is prefilled and decoded here, with no room and no transfer, as a decode node serves one
(``local_path.py``); it has a decode loop for them. Why a node serves both roles rather than switching roles:
``docs/serving.md``, "No idle core".
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

import jax

from fsm_pd.bootstrap import BootstrapServer
from fsm_pd.control.phases import timing_meta
from fsm_pd.effects.decode import RECOMPUTE_NOTE
from fsm_pd.machines.deadlines import explain_failure
from fsm_pd.model.input_buckets import batch_bucket, token_bucket
from fsm_pd.model.loader import LoadedModel
from fsm_pd.scheduling.page_admission import CHUNKED_PREFILL_SIZE, Chunk, end_request, plan_chunks, take_prefill_batch
from fsm_pd.scheduling.step_budget import DEFAULT_CHUNK_STEPS, StepBudget
from fsm_pd.serving.common import ENDED, transfer_failure_status
from fsm_pd.serving.decode_loop import DecodeLoop
from fsm_pd.serving.device_steps import steps_per_dispatch
from fsm_pd.serving.early_prefill import EarlyPrefill
from fsm_pd.serving.forward import FirstToken, input_logprobs_to_wire, prefill_step
from fsm_pd.serving.isolate import run_isolating
from fsm_pd.serving.local_path import LocalPath
from fsm_pd.serving.pd_engine import PDEngine
from fsm_pd.serving.recompute import TransferRecompute
from fsm_pd.serving.retraction import DecodeLoopCollector
from fsm_pd.serving.sequence import Sequence
from fsm_pd.serving.top_logprobs import to_wire as top_logprobs_to_wire
from fsm_pd.serving.types import EngineError, TokenOutput

log = logging.getLogger(__name__)


class PrefillEngine(LocalPath, PDEngine):
    role = "prefill"
    watched = ("WaitingForInput", "Success", "Failed")

    def __init__(self, model: LoadedModel | str = "tiny", *, bootstrap_port: int | None = 0,
                 bootstrap_url: str | None = None, bootstrap_token: str | None = None,
                 bootstrap_uds: str | None = None, max_prefill_batch: int = 8,
                 chunked_prefill_size: int = CHUNKED_PREFILL_SIZE, radix_cache: bool = True,
                 chunk_transfers: bool = True, serve_local: bool = False, max_running: int = 64,
                 prefill_chunk_steps: float = DEFAULT_CHUNK_STEPS, clock: Callable[[], float] = time.perf_counter,
                 decode_steps_per_dispatch: int | None = None, **node):
        """``node``: the settings of every PD node (``PDEngine``: pool size, node id, journal, secret, backend,
        deadlines, host, advertise_host). ``bootstrap_port``: run a bootstrap server on it (0: any free port) and
        register with it (on the unix socket ``bootstrap_uds`` instead, when given); None and a ``bootstrap_url``:
        register with that server instead; None and no URL: do not register (tests that tell the decode side our
        side-channel address directly). ``radix_cache``: reuse cached prompt prefixes (``--disable-radix-cache`` turns
        it off); the decode node still gets every page. ``chunked_prefill_size``: padded prompt tokens a prefill step
        computes; a longer prompt takes several. ``chunk_transfers``: hand such a prompt over chunk by chunk while the
        rest computes (False: after the last chunk, in one piece; the comparison the TTFT bench makes). ``serve_local``:
        also serve requests the router sends here whole, up to ``max_running`` of them decoding at once
        (``local_path.py``); while they decode, every prefill step here (theirs and the PD prompts') costs at most
        ``prefill_chunk_steps`` of their decode steps (``scheduling/step_budget.py``; 0: ``chunked_prefill_size``
        alone), timed on ``clock``. ``decode_steps_per_dispatch``: decode steps one dispatch of those requests may
        run (``DecodeLoop``; None: by the device)."""
        shared = node.get("shared")
        if shared is not None:  # one pool with the decode engine: nothing to cache or stream (shared_pool.py)
            radix_cache = chunk_transfers = False
        super().__init__(model, prefix_cache=radix_cache, **node)
        self.serves_local = serve_local
        # bounds a step in time only while streams decode beside it: the local ones a node serving them has, or
        # the decode engine's that shares this pool and step loop (and then this budget too)
        self.budget = (shared.budget if shared is not None
                       else StepBudget(chunked_prefill_size, prefill_chunk_steps if serve_local else 0))
        # on one pool a prompt is prefilled before its PREPARE, its handoff waits for it (early_prefill.py)
        self.early = EarlyPrefill(self.page_size, lambda: shared.decode_headroom) if shared is not None else None
        if shared is not None:
            shared.prefill_waiting = self._prompts_waiting
            self._driver.react = self.react
        self._clock = clock
        self.prefill_executor = prefill_step  # the model executor port: runs one step's chunks (forward.py)
        if serve_local:
            # a decode node's headroom rule: the streams here grow a page every page_size tokens
            headroom = max(1, (self.layout.num_pages - 1) // 8)
            self.max_running = max_running
            self.loop = DecodeLoop(self.model, self.model_thread, self.allocator, self.page_size,
                                   release=self._finish_local, headroom_pages=headroom, cache=self.cache,
                                   steps_per_dispatch=steps_per_dispatch(decode_steps_per_dispatch,
                                                                         self.model_thread.pool),
                                   first_token_waiting=self._first_token_waiting, max_running=max_running)
            self.recompute = TransferRecompute(self.model, self.model_thread, self.allocator, self.page_size,
                                               enabled=False, headroom_pages=headroom, budget=self.budget, clock=clock)
            self._init_local()
            labels = {"role": "prefill", "node": self.node_id}
            self.registry.register(DecodeLoopCollector(self.loop.counters, labels))
            self.registry.register(self.recompute.collector(labels))
        host = self.manager.host
        self.max_prefill_batch, self.chunked_prefill_size = max_prefill_batch, chunked_prefill_size
        self.chunk_transfers = chunk_transfers
        self._streaming: set[int] = set()  # rooms whose handoff started after their first chunk
        self._to_prefill: deque[Sequence] = deque()  # PREPARE arrived: waiting for pages and the model thread
        self._chunking: list[Sequence] = []  # pages reserved, prompt partly prefilled: the next chunks go first
        self._in_flight: dict[int, FirstToken] = {}  # room -> first token of a prefilled request being pulled
        self.bootstrap_server = None
        if bootstrap_port is not None:
            self.bootstrap_server = BootstrapServer(host, bootstrap_port, token=bootstrap_token,
                                                    uds=bootstrap_uds).start()
            bootstrap_url = self.bootstrap_server.url
        self.bootstrap_url = bootstrap_url
        self._bootstrap_token = bootstrap_token
        if bootstrap_url is not None:
            self.manager.register_with(bootstrap_url, token=bootstrap_token)
        self._driver.start()

    def deregister(self) -> str:
        """Stop being findable (a drain): take this node out of its bootstrap server. Says what happened; raises
        ``BootstrapError`` when the server refused or could not be reached."""
        if self.bootstrap_url is None:
            return "not registered with a bootstrap server"
        if self.manager.deregister_from(self.bootstrap_url, token=self._bootstrap_token):
            return f"deregistered from the bootstrap server at {self.bootstrap_url}"
        return f"the bootstrap server at {self.bootstrap_url} no longer listed this process"

    @property
    def bootstrap_host_port(self) -> tuple[str, int] | None:
        """Where requests for this node should point (``Bootstrap.host``, ``Bootstrap.port``): on a unix socket,
        ``("unix:PATH", 0)``."""
        if self.bootstrap_server is None:
            return None
        if self.bootstrap_server.uds is not None:
            return self.bootstrap_server.url, 0
        return self.manager.advertise_host, self.bootstrap_server.port

    def _open_room(self, seq: Sequence) -> None:
        self.manager.add_sender(seq.key, prompt_len=seq.prompt_len, rid=seq.rid)

    def _role_info(self) -> dict:
        in_flight, waiting, chunking = len(self._in_flight), len(self._to_prefill), len(self._chunking)
        local = {"requests_running": len(self.loop.running), "local_waiting": len(self.recompute.waiting),
                 **self.recompute.local} if self.serves_local else {}
        early = {} if self.early is None else self.early.info()
        waiting += early.get("early_queue", 0)
        return {"bootstrap_queue": max(0, len(self.rooms) - waiting - chunking - in_flight), "prefill_queue": waiting,
                "prefilling": chunking, "in_flight": in_flight, "bootstrap_url": self.bootstrap_url,
                "prefill_budget": self.budget.state(), **early, **local}

    def _role_leaks(self, counters: dict) -> dict:
        return {"staging_buffers_held": counters["staging_buffers_held"]}

    def _close_parts(self) -> None:
        super()._close_parts()
        if self.bootstrap_server is not None:
            self.bootstrap_server.stop()

    # --- the manager's loop thread ---
    def _detail(self, room, decision, at) -> tuple[str | None, dict]:
        timing = timing_meta(self.manager.metrics.phases.take(room.room)) if decision.dst == "Success" else {}
        # a deadline that ended the room is named with what it waited for and who sets it (machines/deadlines.py)
        failed = decision.dst == "Failed"
        reason = explain_failure("prefill", room.reason, room.ctx.get("deadlines")) if failed else None
        return reason, timing

    # --- the model thread ---
    def react(self) -> bool:
        """Take the arrivals and the rooms' events, and nothing more (a shared pool's loop calls it after each pass:
        a prompt prefilled early whose PREPARE just came starts its handoff now); True if it took any event."""
        arrived = self._take_arrivals()
        if self.serves_local:
            arrived = self._take_local(arrived)
        if self.early is not None:
            for seq in arrived:
                self.early.arrived(seq)
        events = self._take_room_events()
        for event in events:
            self._on_room(*event)
        return bool(events)

    def _step(self) -> bool:
        self.react()
        # a prompt whose room ended mid-prefill is dropped: _on_room freed its pages
        self._chunking = [s for s in self._chunking if not self._gone(s)]
        decoding = (self.serves_local and bool(self.loop.running)) or (self.shared is not None and
                                                                       self.shared.decoding())
        budget = self.budget.tokens(decoding)
        chunks = plan_chunks(self._chunking, max_batch=self.max_prefill_batch, budget=budget)
        admitted = take_prefill_batch(self._to_prefill, self.allocator, self.page_size,
                                      max_batch=self.max_prefill_batch - len(chunks), max_tokens=budget, headroom=0,
                                      drop=self._gone, cache=self.cache, planned=chunks)
        self._chunking += admitted
        chunks = plan_chunks(admitted, max_batch=self.max_prefill_batch, budget=budget, planned=chunks)
        if self.early is not None and len(chunks) < self.max_prefill_batch:
            early = take_prefill_batch(self.early.queue, self.allocator, self.page_size,
                                       max_batch=self.max_prefill_batch - len(chunks), max_tokens=budget,
                                       headroom=self.early.headroom(), drop=self._prepared_or_gone, planned=chunks,
                                       headroom_always=True)
            self._chunking += early
            chunks = plan_chunks(early, max_batch=self.max_prefill_batch, budget=budget, planned=chunks)
        if chunks:
            if budget < self.chunked_prefill_size:
                self.budget.cut_steps += 1
            started = self._clock()
            self._prefill(chunks)
            handing_over = self._hand_over_now()
            if self.budget.enabled:  # a step of chunks that all go on samples nothing: wait for its pass here
                with contextlib.suppress(RuntimeError):  # a pool a failed step left deleted: the next step says so
                    jax.block_until_ready(self.model_thread.pool)
                self.budget.observe_prefill(batch_bucket(len(chunks)) * token_bucket(max(c.length for c in chunks)),
                                            self._clock() - started - handing_over)
        # more prompts may fit now; if none fit, a room ending frees pages and kicks us again
        busy = bool(self._chunking) or (bool(chunks) and bool(self._to_prefill))
        if self.serves_local:  # the requests served whole here: their prefill, then one decode step for all
            if not self.loop.resuming:
                self.recompute.prefill(self.max_running - len(self.loop.running), self.loop.add, self._finish_local,
                                       decoding=bool(self.loop.running))
            decoding, started = bool(self.loop.running), self._clock()
            running = self.loop.step()
            if decoding and (cost := self.loop.step_cost(self._clock() - started)) is not None:
                self.budget.observe_decode(cost)
            busy = running or busy or (self.recompute.ready_to_run() and not self.loop.resuming)
        return busy

    def _first_token_waiting(self) -> bool:
        """Prompts to prefill here (PD rooms', or requests served whole): they would wait for a long decode
        dispatch."""
        return self._prompts_waiting() or bool(self.recompute.waiting) or bool(self.recompute.chunking)

    def _prompts_waiting(self) -> bool:
        """PD rooms' prompts not yet prefilled (what a shared pool's decode engine asks: ``prefill_waiting``)."""
        return (bool(self.arrivals) or bool(self._to_prefill) or bool(self._chunking)
                or (self.early is not None and self.early.waiting(self.allocator)))

    def _prepared_or_gone(self, seq: Sequence) -> bool:
        """An early prompt whose PREPARE came first: it moved to the prefill queue (``_on_room``)."""
        return not self.early.unprepared(seq.key) or self._gone(seq)

    def _finish_local(self, seq: Sequence) -> None:
        """A request served whole here ended (or was cancelled): its pages go back."""
        self.requests.pop(seq)
        self._local_ended(seq)

    def _gone(self, seq: Sequence) -> bool:
        """A queued request that ended meanwhile (aborted, or its room failed: ``_on_room`` answers it)."""
        state = self.manager.poll(seq.key)
        return seq.cancelled or self.rooms.get(seq.key) is not seq or state is None or state in ENDED

    def _on_room(self, room: int, state: str, detail: tuple[str | None, dict]) -> None:
        reason, timing = detail
        seq = self.rooms.get(room)
        if state == "WaitingForInput":
            if self.early is not None and self.early.prepared(room):
                if seq is not None and not seq.cancelled:
                    if room in self._in_flight:  # prefilled already: the handoff starts now
                        self._hand_over(seq, self._in_flight[room])
                    elif seq not in self._chunking:  # still queued: first in line now, from its arrival on
                        self._to_prefill.append(seq)
                return
            if seq is not None and not seq.cancelled:
                seq.queued_at = time.monotonic()
                self._to_prefill.append(seq)
            return
        if self.early is not None:
            self.early.ended(room)
        self.rooms.pop(room, None)
        self._streaming.discard(room)
        first = self._in_flight.pop(room, None)
        if seq is not None:
            self.requests.pop(seq)
            if state == "Success" and first is not None:
                self._answer(seq, first, timing)
            elif state == "Failed" and reason is not None and RECOMPUTE_NOTE in reason:
                log.info("room %d (request %s): the transfer failed and the decode node recomputes it: %s", room,
                         seq.rid, reason)
                if first is not None:
                    self._answer(seq, first, {"kv_transfer_failed": reason})
                else:  # mid-way through a chunked prompt: no first token, and none is computed (D computes it)
                    self._answer_without_token(seq, reason)
            elif state == "Failed" and not seq.cancelled:
                seq.stream.push(EngineError(reason or "KV transfer failed", transfer_failure_status(reason)))
        # a request still in the prefill queue is dropped there: its room is gone from the manager. Its prompt's pages
        # join the prefix cache once handed over; a failed transfer frees only the pages the request reserved.
        end_request(self.cache, self.allocator, room, seq, keep=state == "Success")
        self.manager.clear(room)

    def _prefill(self, chunks: list[Chunk]) -> None:
        self._prefilling(chunks)
        firsts = run_isolating(chunks, lambda part: self.prefill_executor(self.model, self.model_thread, part),
                               "prefill")
        for chunk, first in zip(chunks, firsts, strict=True):
            seq = chunk.seq
            if isinstance(first, Exception):  # fail its room (which frees its pages), keep serving the others
                self._chunking.remove(seq)
                self.manager.fail(seq.key, f"prefill failed: {first}")
                continue
            if first is None:  # more chunks to come
                self._chunk_done(seq)
                continue
            self._chunking.remove(seq)
            self._prefilled(seq)
            self._in_flight[seq.key] = first
            if seq.key in self._streaming:
                self._streaming.discard(seq.key)
                self.manager.kv_chunk(seq.key, final_pages=len(seq.pages), first_token=first.token_id)
                continue
            if self.early is not None and self.early.unprepared(seq.key):
                continue  # prefilled before its PREPARE: the handoff waits for it (_on_room)
            self._hand_over(seq, first)

    def _hand_over_now(self) -> float:
        """A shared pool's handoffs this step's prompts started (their ``kv_ready``), decided now rather than after
        the step: the wait for the device below lets go of the interpreter's lock, which a busy event loop then held
        for up to its switch interval while P's rooms sat in Transferring (and their pages in no one's hands). The
        seconds it took, which the prefill budget does not count as the step's (it counted no handoff before)."""
        if self.shared is None:
            return 0.0
        started = self._clock()
        self.shared.node_loop.run_pending()
        return self._clock() - started

    def _hand_over(self, seq: Sequence, first: FirstToken) -> None:
        """The prompt's KV is done and the decode side has prepared: READY (the machine's ``kv_ready``)."""
        self.manager.kv_ready(
            seq.key,
            pages=seq.pages,
            first_token=first.token_id,
            first_logprob=first.logprob,
            input_logprobs=input_logprobs_to_wire(first.input_logprobs),
            top_logprobs=top_logprobs_to_wire(first.top_logprobs, first.input_top_logprobs),
            cached_tokens=seq.prefix.tokens,
        )

    def _chunk_done(self, seq: Sequence) -> None:
        """A chunk that is not the prompt's last ran: start or advance the room's chunk-by-chunk handoff."""
        if not self.chunk_transfers or seq.request.return_logprob:
            return
        final_pages = seq.prefilled // self.page_size
        if seq.key in self._streaming:
            self.manager.kv_chunk(seq.key, final_pages=final_pages)
            return
        self._streaming.add(seq.key)
        self.manager.kv_first_chunk(seq.key, pages=seq.pages, final_pages=final_pages,
                                    piece_pages=max(1, self.chunked_prefill_size // self.page_size),
                                    cached_tokens=seq.prefix.tokens)

    def _answer_without_token(self, seq: Sequence, reason: str) -> None:
        """This leg's answer when the decode node took the request over before this node had its first token (a
        chunked prompt's handoff failed mid-way): a router uses the decode's answer, so this one only has to say
        that the leg is done, with a 200 that the routers wait for (sglang-router answers only when both legs
        succeeded). Its one output id is a placeholder, the prompt's last token; the answer says why."""
        if seq.cancelled:
            return
        seq.stream.push(TokenOutput(
            seq.request.input_ids[-1], finish_reason={"type": "abort", "message": "the decode node recomputes this "
                                                                                  "request"},
            text="", meta={**seq.meta, "completion_tokens": 0, "kv_transfer_failed": reason}))

    def _answer(self, seq: Sequence, first: FirstToken, extra_meta: dict | None = None) -> None:
        if seq.cancelled:
            return
        seq.stream.push(
            TokenOutput(
                first.token_id,
                logprob=first.logprob,
                finish_reason={"type": "length"},
                text=self.model.tokenizer.decode([first.token_id]),
                input_token_logprobs=first.input_logprobs,
                top_logprobs=first.top_logprobs,
                input_top_logprobs=first.input_top_logprobs,
                meta={**seq.meta, "completion_tokens": 1, **(extra_meta or {})},
            )
        )
