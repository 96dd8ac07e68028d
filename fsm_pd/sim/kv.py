"""Simulated pool operations: no bytes move, every buffer and every page write is recorded.

``SimKV`` is the ``PrefillKV`` and ``DecodeKV`` port of one process instance. Its buffers are ``SimBuffer`` records
in the ledger (``staging`` on the prefill side; ``pulled`` ones are made by the simulated transfer). Every write into
a page is checked against who holds the page: a write after ``FreePages`` (or into pages handed to someone else
since) is a violation.

An instance either copies layer by layer (``progressive``: a pool on one CPU device beside a progressive backend)
or whole buffers (a pool on an accelerator), a seeded choice per instance, so both branches of the production
handlers run. Progressive, P either sends the room's pages straight from the pool (``sends_pages``: ``tcp``, the
default; ``SimPoolPages``, read layer by layer under the model thread's ``PoolLease`` while the pull streams them, as
``kernels/page_source.py`` does) or publishes a staging block before gathering it and makes its layers final one at
a time (``zmq``: ``control/overlap.py``). D writes each group of layers as it lands: a ``SimLayerStream``, the
production ``LayerStream`` whose writes are ledger-checked. A prompt prefilled in chunks is handed off piece by piece
by the production handlers; its pieces are gathered here once their pages are final.

Pages carry content tags (``RecordingAllocator.last_writer``: the room whose prefill computed each): a gather or a
send copies them, a pull carries them (a corrupting fault changes one), a write into D's pages stores them, and both
KV checksums hash them, so D's check fails exactly when its pages do not hold what P's did.

The pages themselves are the ``RecordingAllocator``'s (``allocator.py``): every read and write here is checked there.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

from fsm_pd.control.layer_stream import LayerStream
from fsm_pd.sim.allocator import RecordingAllocator
from fsm_pd.sim.ledger import Ledger
from fsm_pd.sim.timeline import Timeline

GATHER_BYTES_PER_S = 10e9  # a layer-by-layer gather into host memory (memcpy speed), on top of a model job's delay
STREAM_GROUP = 2  # layers per streamed write job (the real group depends on page bytes; any divisor will do here)


class _Contiguous:
    c_contiguous = True


class SimBuffer:
    """A staging or pulled array, as far as the handlers and ``StagingProgress`` can tell: rows, bytes, whose KV."""

    __slots__ = ("content", "corrupt", "key", "kind", "nbytes", "room", "rows", "words")
    flags = _Contiguous()

    def __init__(self, key: int, kind: str, room: int | None, rows: int, page_bytes: int, *,
                 words: list[int] | None = None, corrupt: str | None = None):
        self.key, self.kind, self.room, self.rows = key, kind, room, rows
        self.nbytes = rows * page_bytes
        self.words = words  # a chunked handoff's trailer: the first token
        self.corrupt = corrupt  # why its bytes are not the room's KV (None: they are)
        # what its bytes are, page by page: the room whose prefill computed each (``last_writer``), or a mark of
        # what corrupted it; D's pages take these tags when it is written, and both checksums hash tags
        self.content: tuple = ()

    @property
    def shape(self) -> tuple[int, int]:
        return (1, self.rows)

    def __repr__(self) -> str:
        return f"{self.kind} buffer #{self.key} of room {self.room}"


class SimPoolPages:
    """``kernels/page_source.PoolPages`` as far as the transfer sees it: the staging bytes of a room's ``pages``,
    never gathered, read in place from the pool under the model thread's ``PoolLease`` (the production one:
    ``SimModel.lease``) while a pull streams them. The pages are the room's reader's from ``publish_pages`` until
    the hold ends (``hold`` / ``let_go``); every read is checked against who holds each page and who wrote it last,
    so a page freed and reused while its send runs is seen, and what the pull takes away is marked corrupt."""

    kind = "pool pages"
    key = None
    flags = _Contiguous()

    def __init__(self, owner: Any, pages: list[int], room: int, allocator: RecordingAllocator, page_bytes: int,
                 layers: int):
        self.owner, self.pages, self.room, self.allocator = owner, list(pages), room, allocator
        self.layers = layers
        self.rows = len(pages)
        self.nbytes = self.rows * page_bytes
        self.corrupt: str | None = None
        self.content = [allocator.last_writer.get(page) for page in self.pages]
        self.who = f"the send from the pool of room {room}"

    @property
    def shape(self) -> tuple[int, int]:
        return (1, self.rows)

    def hold(self) -> None:
        self.allocator.begin(self.pages, self.who)

    def let_go(self) -> None:
        self.allocator.end(self.pages, self.who)

    def reader(self) -> Any:
        return self.owner.lease.turn()

    def read(self, turn: Any, start: int, stop: int) -> None:
        """Send staging bytes ``[start, stop)`` (``[L, rows, page]``): under the lease, the pages of the rows they
        come from must be the room's and hold its final KV."""
        layer_bytes = self.nbytes // self.layers
        row_bytes = max(1, layer_bytes // self.rows)
        if (stop - 1) // layer_bytes > start // layer_bytes:
            rows = range(self.rows)  # more than one layer: every row
        else:
            rows = range((start % layer_bytes) // row_bytes, ((stop - 1) % layer_bytes) // row_bytes + 1)
        pages = [self.pages[row] for row in rows]
        with self.owner.lease.read(turn):
            if not self.allocator.check_read(self.room, pages, "a send from the pool") and self.corrupt is None:
                self.corrupt = "a page was freed and reused while its send from the pool read it"
            for row in rows:  # what goes out is what the page holds now
                self.content[row] = self.allocator.last_writer.get(self.pages[row])

    def __repr__(self) -> str:
        return f"pool pages {self.pages[:4]}... of room {self.room}"


class SimLayerStream(LayerStream):
    """The production ``LayerStream``; a write is a ledger-checked page write of the room that pulls. Its pages are
    busy (being written) from its start until it has written the last layer or is cancelled."""

    def __init__(self, model: Any, pages: list[int], room: int, allocator: RecordingAllocator, *, num_layers: int,
                 layer_bytes: int):
        super().__init__(model, pages, num_layers=num_layers, layer_bytes=layer_bytes, group=STREAM_GROUP)
        self.room, self.allocator = room, allocator
        self.who = f"the streamed scatter of room {room}"
        allocator.begin(pages, self.who)

    def written(self, owner: Any) -> None:
        try:
            super().written(owner)
        finally:
            self.allocator.end(self.pages, self.who)

    def cancel(self) -> None:
        super().cancel()
        self.allocator.end(self.pages, self.who)

    def stage(self, host: Any, layer: int) -> tuple:
        return tuple(host.content)  # what the layers that landed hold

    def write(self, owner: Any, layer: int, staged: tuple) -> None:
        layers = f"layers {layer}-{layer + self.group - 1}"
        self.allocator.check_write(self.room, self.pages, f"a streamed write of {layers}", staged, writer=self.who)


class SimKV:
    on_model_thread = True  # every job copies KV in the pool (effects/ports.py, run_kv_job)

    def __init__(self, ledger: Ledger, sched: Timeline, model: Any, instance: Any, page_bytes: int,
                 num_layers: int, *, progressive: bool, sends_pages: bool = False,
                 room_of_pages: Callable[[list[int]], int | None] | None = None,
                 allocator: RecordingAllocator | None = None):
        """``sends_pages``: a progressive instance whose backend sends straight from the pool (``tcp``, the
        default); else a progressive one gathers layer by layer into a published block (``zmq``)."""
        self.ledger, self.sched, self.model, self.instance = ledger, sched, model, instance
        self.page_bytes, self.num_layers, self.progressive = page_bytes, num_layers, progressive
        self.sends_pages = sends_pages
        self.room_of_pages, self.allocator = room_of_pages, allocator
        # rooms whose KV a seeded fault changed between P's checksum and D's (the wire, a page reused on P, a page of
        # D's pool overwritten): D's checksum of them differs from P's, as the real bytes' would
        self.corrupted: set[int] = set()

    # --- the KV checksum: no bytes here, so a token per piece and layer from what both sides know of the room ---
    def _checksum(self, tags: tuple, plan: Any) -> list[list[int]]:
        return [[zlib.crc32(f"{tags}:{piece.index}:{layer}".encode()) for layer in range(self.num_layers)]
                for piece in plan.pieces]

    def sent_checksum(self, owner: Any, pages: list[int], plan: Any) -> list[list[int]]:
        """Of what ``pages`` hold now (their tags): what D's pages must hold once written."""
        return self._checksum(self.tags(pages), plan)

    def checksum_later(self, owner: Any, pages: list[int], plan: Any, done: Callable[[list[list[int]]], None]) -> None:
        """As ``JaxKV.checksum_later``: the pages as the publishing job leaves them (read before any other job could
        change them: the real one sums as the send reads and finishes at the next job's start), reported at once."""
        done(self.sent_checksum(owner, pages, plan))

    def received_checksum(self, owner: Any, pages: list[int], plan: Any) -> list[list[int]]:
        room = self.allocator.owner.get(pages[0])  # the room holding them; None after its FreePages
        values = self._checksum(self.tags(pages), plan)
        if room in self.corrupted:
            values[0][0] ^= 1
        return values

    # --- prefill ---
    def gather(self, owner: Any, pages: list[int], plan: Any) -> tuple[SimBuffer, ...]:
        """One staging buffer per piece of the plan (one without tensor parallelism), each its share of the bytes.
        The gather reads ``pages``: each must be the room's, with its KV final (a chunk's piece only once its
        chunk ran). A piece wholly of a cached prefix names no room: the transfer server finds it by uuid."""
        room = self.room_of_pages(pages)
        corrupt = None
        if room is not None and not self.allocator.check_read(room, pages, "a gather"):
            corrupt = "the gather read pages that were not the room's final KV"
        slots = sum(piece.count for piece in plan.pieces)
        bufs = tuple(SimBuffer(self.ledger.new_id(), "staging", room, len(pages),
                               self.page_bytes * piece.count // slots, corrupt=corrupt) for piece in plan.pieces)
        for buf in bufs:
            buf.content = self.tags(pages)
            self.ledger.alloc("staging", buf.key, self.instance, room)
        return bufs

    def tags(self, pages: list[int]) -> tuple:
        """What ``pages`` of this pool hold: the room whose KV each is (see ``SimBuffer.content``)."""
        return tuple(self.allocator.last_writer.get(page) for page in pages)

    def _staging(self, pages: list[int]) -> SimBuffer:
        room = self.room_of_pages(pages)
        buf = SimBuffer(self.ledger.new_id(), "staging", room, len(pages), self.page_bytes)
        buf.content = self.tags(pages)  # the layer-by-layer gather runs now, as far as what it reads goes
        self.ledger.alloc("staging", buf.key, self.instance, room)
        return buf

    def gathers_progressively(self, owner: Any) -> bool:
        return self.progressive

    summed = True  # the simulated pool's tokens are always summed
    checksum_algorithm = "sim"  # both sides' tokens: READY names it as it names a real one

    def publish_while_gathering(self, owner: Any, transfer: Any, uuid: int, pages: list[int], hold_timeout_s: float,
                                on_published: Callable[[int], None]) -> None:
        """As ``JaxKV.publish_while_gathering``: where the backend sends from the pool's pages and the model thread
        lends them (its ``lease``), nothing is gathered: the entry is the pages themselves (``SimPoolPages``), read
        while the pull streams them. Else as ``overlap.publish_while_gathering``: publish the (warm) staging block,
        READY may go, then the gather makes one layer final after another, while the model thread does nothing
        else."""
        if self.sends_pages and getattr(transfer, "sends_pages", False) and getattr(owner, "lease", None) is not None:
            room = self.room_of_pages(pages)
            self.allocator.check_read(room, pages, "publishing a send from the pool")
            source = SimPoolPages(owner, pages, room, self.allocator, self.page_bytes, self.num_layers)
            transfer.publish_pages(uuid, source, hold_timeout_s)
            on_published(source.shape[1])
            return
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

    def trailer(self, words: list[int]) -> SimBuffer:
        """A chunked handoff's trailer: its room is found by the transfer server from the uuid it is published as."""
        buf = SimBuffer(self.ledger.new_id(), "staging", None, 1, 4 * len(words), words=list(words))
        self.ledger.alloc("staging", buf.key, self.instance, None)
        return buf

    def discard(self, staging: SimBuffer) -> None:
        self.ledger.free(staging.kind, staging.key, by="the handler discarding it")

    # --- decode ---
    def corrupt(self, staging: SimBuffer) -> SimBuffer:
        """As ``JaxKV.corrupt`` (only ``FSM_PD_FAULT_CORRUPT_PULL`` calls it; the simulation's faults are its
        ``FaultPlan``'s): the first page's tag changed."""
        staging.content = (f"corrupted ({staging.content[0]})", *staging.content[1:])
        return staging

    def read_trailer(self, staging: SimBuffer) -> list[int]:
        return list(staging.words)

    def stream(self, pages: list[int]) -> SimLayerStream | None:
        if not self.progressive:
            return None
        room = self.allocator.owner[pages[0]]  # the room pulling into them holds them now
        return SimLayerStream(self.model, pages, room, self.allocator, num_layers=self.num_layers,
                              layer_bytes=len(pages) * self.page_bytes // self.num_layers)

    def complete_stream(self, stream: SimLayerStream, staging: SimBuffer) -> bool:
        if not stream.submitted:
            self.allocator.end(stream.pages, stream.who)  # it will never write: the whole scatter does
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
        # the pieces of a resharded handoff carry parts of the same pages: a page is what all of them say it is
        content = tuple(tags[0] if len(set(tags)) == 1 else f"corrupted ({tags})"
                        for tags in zip(*(piece.content for piece in pieces), strict=True))
        self.allocator.check_write(room, pages, "a write", content)

    def cancel(self, stream: SimLayerStream) -> None:
        stream.cancel()
