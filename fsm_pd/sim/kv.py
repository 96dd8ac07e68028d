"""Simulated pool operations and page allocator: no bytes move, every buffer and every page write is recorded.

``SimKV`` is the ``PrefillKV`` and ``DecodeKV`` port of one process instance. Its buffers are ``SimBuffer`` records
in the ledger (``staging`` on the prefill side; ``pulled`` ones are made by the simulated transfer). Every write into
a page is checked against who holds the page: a write after ``FreePages`` (or into pages handed to someone else
since) is a violation.

An instance either copies layer by layer (``progressive``: a pool on one CPU device beside a progressive backend)
or whole buffers (a pool on an accelerator), a seeded choice per instance, so both branches of the production
handlers run. Progressive, P publishes the staging buffer before gathering it and makes its layers final one at a
time over virtual time (``publish_while_gathering``, the model thread busy meanwhile): what production does with the
``zmq`` backend (``control/overlap.py``). With ``tcp`` production gathers nothing there: ``JaxKV`` sends P's pages
straight from the pool (``kernels/page_source.py``); the handler makes the same call and gets the same
``published``, but the pool lease and the in-place reads are not modelled here (``tests/unit/test_page_source.py``
covers them). D writes each group of layers as it lands: a ``SimLayerStream``, the production ``LayerStream`` whose
writes are ledger-checked. Rooms are never handed off chunk by chunk here (``kv_chunk``): the simulation prefills
each prompt whole.

``RecordingAllocator`` is the real ``PageAllocator`` with every reservation and every free attempt written to the
ledger, and a page -> room map for the write check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsm_pd.control.layer_stream import LayerStream
from fsm_pd.model.pages import PageAllocator
from fsm_pd.sim.ledger import Ledger
from fsm_pd.sim.timeline import Timeline

GATHER_BYTES_PER_S = 10e9  # a layer-by-layer gather into host memory (memcpy speed), on top of a model job's delay
STREAM_GROUP = 2  # layers per streamed write job (the real group depends on page bytes; any divisor will do here)


class _Contiguous:
    c_contiguous = True


class SimBuffer:
    """A staging or pulled array, as far as the handlers and ``StagingProgress`` can tell: rows, bytes, whose KV."""

    __slots__ = ("key", "kind", "nbytes", "room", "rows")
    flags = _Contiguous()

    def __init__(self, key: int, kind: str, room: int, rows: int, page_bytes: int):
        self.key, self.kind, self.room, self.rows = key, kind, room, rows
        self.nbytes = rows * page_bytes

    @property
    def shape(self) -> tuple[int, int]:
        return (1, self.rows)

    def __repr__(self) -> str:
        return f"{self.kind} buffer #{self.key} of room {self.room}"


class RecordingAllocator(PageAllocator):
    def __init__(self, num_pages: int, ledger: Ledger, instance: Any):
        super().__init__(num_pages)
        self.ledger, self.instance = ledger, instance
        self.owner: dict[int, int] = {}  # page -> room holding it
        # page -> rooms whose live request uses it from the prefix cache (recorded by the simulation, not the cache)
        self.in_use: dict[int, list[int]] = {}

    # --- what the simulation saw the requests take and let go ---
    def use(self, pages: tuple[int, ...], room: int) -> None:
        for page in pages:
            self.in_use.setdefault(page, []).append(room)

    def unuse(self, pages: tuple[int, ...]) -> None:
        for page in pages:
            users = self.in_use[page]
            users.pop()
            if not users:
                del self.in_use[page]

    # --- the allocator, recorded and checked ---
    def reserve(self, room: int, count: int) -> list[int]:
        pages = super().reserve(room, count)
        self.ledger.alloc("pages", (self.instance.name, room), self.instance, room)
        self._handed(room, pages)
        return pages

    def extend(self, room: int, count: int) -> list[int]:
        pages = super().extend(room, count)
        self._handed(room, pages)
        return pages

    def _handed(self, room: int, pages: list[int]) -> None:
        """``pages`` go to ``room``: none may be another room's, on a live request's cached prefix, or cached."""
        cached = self.reclaimer.held_pages() if self.reclaimer is not None else set()
        for page in pages:
            if self.owner.get(page) is not None:
                self.ledger.violation(f"{self.instance.name}: page {page} handed to room {room}, but room "
                                      f"{self.owner[page]} holds it")
            if page in self.in_use:
                self.ledger.violation(f"{self.instance.name}: page {page} handed to room {room} while the cached "
                                      f"prefix of live room(s) {self.in_use[page]} uses it")
            if page in cached:
                self.ledger.violation(f"{self.instance.name}: page {page} handed to room {room} while the prefix "
                                      "cache holds it")
            self.owner[page] = room

    def adopt(self, room: int, pages: list[int]) -> None:
        super().adopt(room, pages)
        for page in pages:
            self.owner.pop(page, None)

    def release(self, pages: list[int]) -> None:
        for page in pages:
            if page in self.in_use:
                self.ledger.violation(f"{self.instance.name}: the prefix cache freed page {page}, which the cached "
                                      f"prefix of live room(s) {self.in_use[page]} uses")
        super().release(pages)

    def free(self, room: int) -> int:
        pages = self.pages_of(room)
        freed = super().free(room)
        self.ledger.free("pages", (self.instance.name, room), by="the room's free")
        for page in pages:
            self.owner.pop(page, None)
        return freed

    def accounting(self) -> list[str]:
        """Every page is exactly one of: free, a room's, the cache's; and the cache's lock counts are the live
        requests' uses. Meaningful when no step or callback is under way."""
        name, found = self.instance.name, []
        free, owned = set(self._free), set(self.owner)
        cache = self.reclaimer
        cached = cache.held_pages() if cache is not None else set()
        for what, a, b in (("free and a room's", free, owned), ("free and cached", free, cached),
                           ("a room's and cached", owned, cached)):
            if a & b:
                found.append(f"{name}: pages {sorted(a & b)[:5]} are both {what}")
        lost = set(range(1, self.num_pages)) - free - owned - cached
        if lost:
            found.append(f"{name}: pages {sorted(lost)[:5]} leaked: neither free, nor a room's, nor cached")
        locks = cache.lock_counts() if cache is not None else {}
        for page in sorted(set(locks) | set(self.in_use)):
            users = self.in_use.get(page, [])
            if locks.get(page, 0) != len(users):
                found.append(f"{name}: cached page {page} is locked {locks.get(page, 0)} times, used by live "
                             f"room(s) {users}")
        return found

    def check_write(self, room: int, pages: list[int], what: str) -> None:
        """A write of ``room``'s KV reaches ``pages``: each must still be held by ``room``."""
        self.ledger.writes += 1
        for page in pages:
            holder = self.owner.get(page)
            if holder != room:
                whose = "nobody" if holder is None else f"room {holder}"
                self.ledger.violation(f"{what} of room {room} reached page {page}, held by {whose} "
                                      "(after its FreePages)")


class SimLayerStream(LayerStream):
    """The production ``LayerStream``; a write is a ledger-checked page write of the room that pulls."""

    def __init__(self, model: Any, pages: list[int], room: int, allocator: RecordingAllocator, *, num_layers: int,
                 layer_bytes: int):
        super().__init__(model, pages, num_layers=num_layers, layer_bytes=layer_bytes, group=STREAM_GROUP)
        self.room, self.allocator = room, allocator

    def stage(self, host: Any, layer: int) -> int:
        return layer

    def write(self, owner: Any, layer: int, staged: int) -> None:
        layers = f"layers {layer}-{layer + self.group - 1}"
        self.allocator.check_write(self.room, self.pages, f"a streamed write of {layers}")


class SimKV:
    def __init__(self, ledger: Ledger, sched: Timeline, model: Any, instance: Any, page_bytes: int,
                 num_layers: int, *, progressive: bool, room_of_pages: Callable[[list[int]], int] | None = None,
                 allocator: RecordingAllocator | None = None):
        self.ledger, self.sched, self.model, self.instance = ledger, sched, model, instance
        self.page_bytes, self.num_layers, self.progressive = page_bytes, num_layers, progressive
        self.room_of_pages, self.allocator = room_of_pages, allocator

    # --- prefill ---
    def gather(self, owner: Any, pages: list[int], plan: Any) -> tuple[SimBuffer, ...]:
        """One staging buffer per piece of the plan (one without tensor parallelism), each its share of the bytes."""
        room = self.room_of_pages(pages)
        slots = sum(piece.count for piece in plan.pieces)
        bufs = tuple(SimBuffer(self.ledger.new_id(), "staging", room, len(pages),
                               self.page_bytes * piece.count // slots) for piece in plan.pieces)
        for buf in bufs:
            self.ledger.alloc("staging", buf.key, self.instance, room)
        return bufs

    def _staging(self, pages: list[int]) -> SimBuffer:
        room = self.room_of_pages(pages)
        buf = SimBuffer(self.ledger.new_id(), "staging", room, len(pages), self.page_bytes)
        self.ledger.alloc("staging", buf.key, self.instance, room)
        return buf

    def gathers_progressively(self, owner: Any) -> bool:
        return self.progressive

    def publish_while_gathering(self, owner: Any, transfer: Any, uuid: int, pages: list[int], hold_timeout_s: float,
                                on_published: Callable[[int], None]) -> None:
        """As ``overlap.publish_while_gathering``: publish the (warm) staging block, READY may go, then the gather
        makes one layer final after another, while the model thread does nothing else."""
        block = self._staging(pages)
        try:
            progress = transfer.publish_progressive(uuid, block, hold_timeout_s)
        except BaseException:
            self.ledger.free("staging", block.key, by="the warm block going back unpublished")
            raise
        on_published(block.rows)
        layer_bytes = block.nbytes // self.num_layers
        # as long as a model job, plus the copy: a slow model thread gathers slowly too, and D then waits for layers
        layer_s = (self.model.delay() + block.nbytes / GATHER_BYTES_PER_S) / self.num_layers
        for layer in range(self.num_layers):
            final = (layer + 1) * layer_bytes
            self.sched.later((layer + 1) * layer_s, lambda final=final: progress.advance(final), self.instance)
        self.model.busy_for(self.num_layers * layer_s)

    def discard(self, staging: SimBuffer) -> None:
        self.ledger.free(staging.kind, staging.key, by="the handler discarding it")

    # --- decode ---
    def stream(self, pages: list[int]) -> SimLayerStream | None:
        if not self.progressive:
            return None
        room = self.allocator.owner[pages[0]]  # the room pulling into them holds them now
        return SimLayerStream(self.model, pages, room, self.allocator, num_layers=self.num_layers,
                              layer_bytes=len(pages) * self.page_bytes // self.num_layers)

    def complete_stream(self, stream: SimLayerStream, staging: SimBuffer) -> bool:
        if not stream.submitted:
            return False  # nothing landed early: one whole scatter is cheaper (as JaxKV)
        stream.on_progress(0, staging, staging.nbytes)
        return True

    def scatter(self, owner: Any, pieces: tuple[SimBuffer, ...], pages: list[int], stream: SimLayerStream | None,
                plan: Any) -> None:
        if stream is not None:
            stream.written(owner)
            return
        room = pieces[0].room
        if any(piece.room != room for piece in pieces):
            self.ledger.violation(f"one write mixes the pieces of rooms {sorted({p.room for p in pieces})}")
        self.allocator.check_write(room, pages, "a write")

    def cancel(self, stream: SimLayerStream) -> None:
        stream.cancel()
