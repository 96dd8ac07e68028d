"""The engines' schedulers, as far as pages go: the production admission and prefix caches on the model thread.

``PrefillScheduler`` is the prefill engine's: a request joins the prefill queue once its room waits for input
(PREPARE came, with the pages the decode node's cache already holds); a step admits prompts with the production
``take_prefill_batch`` over the real ``PrefixCache`` (the longest cached prefix locked, only the rest reserved,
LRU eviction when the pool runs short), the prompt prefills for a while and ``kv_ready`` hands its pages over. When
the room ends, ``end_request`` lets them go: handed over (Success), the prompt's full pages join the cache.

``DecodeScheduler`` is the decode engine's: the production ``Preallocation`` (``admit_waiting``, the headroom rule,
``max_running``) grants pages through ``NodeCore.give_pages`` with ``cached_pages`` when the node runs its own
cache (``SimConfig.decode_radix_cache``, drawn per world), and ``SchedulerAdmission`` lets the machine's
``FreePages`` give them back. A request that reached Success decodes up to ``decode_tokens`` tokens in the decode
loop (``decode_loop.py``: growth, retraction under pressure, resume with recompute), then finishes as the engine's
does.

In a shared pool (``shared_pool.py``) both use the production ``AllocatorView`` of the one pool, as the engines of
``--role pd`` do: the prefill engine then keeps no cache and hands a prompt off whole after its last chunk (the
prefill engine's ``shared`` turns both off), and the decode engine decodes from the pages its room adopted (the
room's ``pages`` after ``scattered``, as ``DecodeEngine._on_room`` takes them).

Both record what each live request uses of its cache (``RecordingAllocator.use``): the invariants compare that
with the cache's own lock counts, and check that no such page is ever freed or handed to another request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsm_pd.control.admission import SchedulerAdmission
from fsm_pd.kvpool.prefix_cache import NO_MATCH, Match, PrefixCache
from fsm_pd.scheduling.page_admission import CHUNKED_PREFILL_SIZE, end_request, flush_when_idle, take_prefill_batch
from fsm_pd.scheduling.prealloc import Preallocation
from fsm_pd.sim.allocator import RecordingAllocator
from fsm_pd.sim.decode_loop import SimDecodeLoop

if TYPE_CHECKING:
    from fsm_pd.sim.world import World

MAX_PREFILL_BATCH = 8  # the prefill engine's default
MAX_RUNNING = 64  # the decode engine's default
PREFILL_STEP_S, PREFILL_TOKEN_S = 0.0005, 1e-6  # a prefill chunk's time on the model thread: a step, per token


@dataclass(frozen=True, slots=True)
class Prompt:
    input_ids: Sequence[int]  # 2-byte tokens (``array('H')``): a run keeps every pending prompt
    return_logprob: bool = False


@dataclass(eq=False)
class SimRequest:
    """What the schedulers read and write of a serving ``Sequence``."""

    key: int
    prompt_len: int
    request: Prompt
    pages: list[int] = field(default_factory=list)
    prefix: Match = NO_MATCH
    prefilled: int = 0
    queued_at: float = 0.0
    meta: dict = field(default_factory=dict)
    used: tuple[int, ...] = ()  # the cached pages it uses, as the simulation recorded them when it took them


class _Scheduler:
    def __init__(self, world: World, inst: Any, allocator: RecordingAllocator, cache: PrefixCache | None):
        self.world, self.inst, self.allocator, self.cache = world, inst, allocator, cache
        self.page_size = world.decode_layout["page_size"]
        self._queued = False

    def kick(self) -> None:
        """Run a step on the model thread, unless one is queued already (the engine's ``StepDriver``)."""
        if not self._queued:
            self._queued = True
            self.inst.model.submit(self._run)

    def _run(self, owner: Any) -> None:
        self._queued = False
        self.step()

    def step(self) -> None:
        raise NotImplementedError

    def took(self, seq: SimRequest) -> None:
        seq.used = tuple(seq.prefix.pages)
        self.allocator.use(seq.used, seq.key)

    def let_go(self, seq: SimRequest) -> None:
        self.allocator.unuse(seq.used, seq.key)
        seq.used = ()

    def flush(self) -> None:
        """SGLang's ``/flush_cache``, on the model thread: refused while a request is live."""
        self.inst.model.submit(lambda owner: flush_when_idle(self.allocator, self.live(), self.cache))

    def live(self) -> int:
        raise NotImplementedError


class PrefillScheduler(_Scheduler):
    def __init__(self, world: World, inst: Any):
        page_size = world.decode_layout["page_size"]
        if inst.process is not None:  # one pool with the decode engine: no cache, no chunk-by-chunk handoff
            super().__init__(world, inst, inst.process.view("prefill", inst), None)
        else:
            allocator = RecordingAllocator(world.config.prefill_pages, world.ledger, inst)
            super().__init__(world, inst, allocator, PrefixCache(allocator, page_size))
        self.streams_chunks = inst.process is None
        self.requests: dict[int, SimRequest] = {}  # room -> its live request
        self.queue: deque[SimRequest] = deque()
        self.streaming: set[int] = set()  # rooms handed off chunk by chunk (``kv_first_chunk`` sent)

    def arrived(self, room: int, tokens: Sequence[int]) -> None:
        self.requests[room] = SimRequest(room, len(tokens), Prompt(tokens))

    def observed(self, room: Any, decision: Any) -> None:
        """The manager's observer: queue a room that waits for input; let go of one that ended."""
        if decision.dst == decision.src:
            return
        seq = self.requests.get(room.room)
        if decision.dst == "WaitingForInput" and seq is not None:
            self.queue.append(seq)
            self.kick()
        elif room.terminal:
            seq = self.requests.pop(room.room, None)
            self.streaming.discard(room.room)
            keep = decision.dst == "Success"
            self.inst.model.submit(lambda owner: self._ended(room.room, seq, keep))

    def _ended(self, room: int, seq: SimRequest | None, keep: bool) -> None:
        end_request(self.cache, self.allocator, room, seq, keep=keep)
        if seq is not None:
            self.let_go(seq)
        self.kick()  # pages came back: the head of the queue may fit now

    def step(self) -> None:
        admitted = take_prefill_batch(self.queue, self.allocator, self.page_size, max_batch=MAX_PREFILL_BATCH,
                                      max_tokens=CHUNKED_PREFILL_SIZE, headroom=0, drop=self._gone, cache=self.cache)
        for seq in admitted:
            self.took(seq)
            seq.prefilled = seq.prefix.tokens
            self.inst.model.submit(lambda owner, seq=seq: self._compute(seq))
        if admitted and self.queue:
            self.kick()

    def _compute(self, seq: SimRequest) -> None:
        """Model thread: compute the prompt's next chunk (the whole rest, unless the world prefills in chunks of
        ``chunk_tokens``). Its pages are being written until the chunk is done: the thread is busy meanwhile."""
        if self._gone(seq):
            return  # the room ended: nothing more is computed
        chunk = self.world.chunk_tokens or seq.prompt_len
        start, end = seq.prefilled, min(seq.prompt_len, seq.prefilled + chunk)
        pages = seq.pages[start // self.page_size:-(-end // self.page_size)]
        who = f"the prefill of room {seq.key}"
        self.allocator.begin(pages, who)
        seconds = PREFILL_STEP_S + (end - start) * PREFILL_TOKEN_S
        self.inst.model.busy_for(seconds)
        self.world.sched.later(seconds, lambda: self._computed(seq, pages, end, who), self.inst)

    def _computed(self, seq: SimRequest, pages: list[int], end: int, who: str) -> None:
        """A chunk ran (as the engine's ``_prefill``): its pages hold final KV. After a chunk that is not the last,
        start or advance the room's chunk-by-chunk handoff (``kv_first_chunk``, ``kv_chunk``) and queue the next;
        after the last, hand the prompt over (``kv_ready``, or the last ``kv_chunk`` with the first token)."""
        self.allocator.end(pages, who)
        self.allocator.wrote(seq.key, pages)
        if self._gone(seq):
            return  # a room that ended mid-prefill is dropped
        seq.prefilled = end
        core = self.inst.core
        if end < seq.prompt_len:
            final_pages = end // self.page_size
            if self.streams_chunks and seq.key in self.streaming:  # (a shared pool hands off whole, at the end)
                core.kv_chunk(seq.key, final_pages=final_pages)
            elif self.streams_chunks:
                self.streaming.add(seq.key)
                core.kv_first_chunk(seq.key, pages=list(seq.pages), final_pages=final_pages,
                                    piece_pages=max(1, self.world.chunk_tokens // self.page_size),
                                    cached_tokens=seq.prefix.tokens)
            self.inst.model.submit(lambda owner: self._compute(seq))
            return
        first_token = self.world.rng.randrange(256)
        if seq.key in self.streaming:
            self.streaming.discard(seq.key)
            core.kv_chunk(seq.key, final_pages=len(seq.pages), first_token=first_token)
        else:
            core.kv_ready(seq.key, pages=list(seq.pages), first_token=first_token, cached_tokens=seq.prefix.tokens)

    def _gone(self, seq: SimRequest) -> bool:
        return self.requests.get(seq.key) is not seq

    def live(self) -> int:
        return len(self.requests)


class DecodeScheduler(_Scheduler):
    def __init__(self, world: World, inst: Any):
        pages = world.config.num_pages if inst.process is None else world.shared_pages
        allocator = (RecordingAllocator(pages, world.ledger, inst) if inst.process is None
                     else inst.process.view("decode", inst))
        page_size = world.decode_layout["page_size"]
        cache = PrefixCache(allocator, page_size) if world.decode_radix_cache else None
        super().__init__(world, inst, allocator, cache)
        self.prealloc = Preallocation(allocator, page_size, headroom=max(1, (pages - 1) // 8), grant=self._grant,
                                      cache=cache, kick=self.kick)
        self.admission = SchedulerAdmission(on_release=self.prealloc.release)
        self.rooms: dict[int, SimRequest] = {}  # waiting for pages or transferring
        self.loop = SimDecodeLoop(self)  # requests whose handoff succeeded: decoding, retracted, recomputing

    def arrived(self, room: int, tokens: Sequence[int]) -> None:
        seq = self.rooms[room] = SimRequest(room, len(tokens), Prompt(tokens))
        self.prealloc.waiting.append(seq)
        self.kick()

    def step(self) -> None:
        if self.loop.resuming:
            return  # retracted requests go first (``DecodeLoop.resuming``): the loop kicks again once they are back
        in_transfer = len(self.rooms) - len(self.prealloc.waiting)
        self.prealloc.admit(MAX_RUNNING - len(self.loop) - in_transfer, self._gone)

    def _grant(self, room: int, pages: list[int], cached_pages: int) -> None:
        self.took(self.rooms[room])
        self.inst.core.give_pages(room, pages, cached_pages)

    def _gone(self, seq: SimRequest) -> bool:
        found = self.inst.node.rooms.get(seq.key)
        return self.rooms.get(seq.key) is not seq or found is None or found.terminal

    def observed(self, room: Any, decision: Any) -> None:
        if decision.dst == decision.src or decision.dst not in ("Success", "Failed"):
            return
        seq = self.rooms.pop(room.room, None)
        if seq is None:
            return  # a room recovered from the journal: no request of ours
        if decision.dst == "Failed":  # its own pages are its FreePages'; its cached prefix goes back here
            self.inst.model.submit(lambda owner: self._failed(seq))
            return
        tokens = self.world.rng.randint(1, self.world.config.decode_tokens)
        pages = list(room.ctx["pages"])  # as the engine takes them: in a shared pool, the pages its room adopted
        self.inst.model.submit(lambda owner: self.loop.add(seq, tokens, pages))

    def _failed(self, seq: SimRequest) -> None:
        self.prealloc.failed(seq)
        self.let_go(seq)

    def finish(self, seq: SimRequest) -> None:
        """The loop finished the request (model thread): its prompt pages join the cache, the rest are freed."""
        self.prealloc.finished(seq)
        self.let_go(seq)
        self.inst.effects.finish(self.inst.node, seq.key)  # FreePages' release, on the model thread
        self.kick()

    def live(self) -> int:
        return len(self.rooms) + len(self.loop)
