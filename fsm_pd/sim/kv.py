"""Simulated pool operations and page allocator: no bytes move, every buffer and every page write is recorded.

``SimKV`` is the ``PrefillKV`` and ``DecodeKV`` port of one process instance. Its buffers are ``SimBuffer`` records
in the ledger (``staging`` on the prefill side; ``pulled`` ones are made by the simulated transfer). A scatter checks
that every page it writes is still reserved by the room the data belongs to: a write after ``FreePages`` (or into
pages handed to someone else since) is a violation.

``RecordingAllocator`` is the real ``PageAllocator`` with every reservation and every free attempt written to the
ledger, and a page -> room map for the write check.
"""

from __future__ import annotations

from typing import Any

from fsm_pd.model.pages import PageAllocator
from fsm_pd.sim.ledger import Ledger


class SimBuffer:
    """A staging or pulled array, as far as the handlers can tell: rows, bytes, and whose KV it is."""

    __slots__ = ("key", "kind", "nbytes", "room", "rows")

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

    def reserve(self, room: int, count: int) -> list[int]:
        pages = super().reserve(room, count)
        self.ledger.alloc("pages", (self.instance.name, room), self.instance, room)
        self.owner.update(dict.fromkeys(pages, room))
        return pages

    def free(self, room: int) -> int:
        pages = self.pages_of(room)
        freed = super().free(room)
        self.ledger.free("pages", (self.instance.name, room), by="admission.release")
        for page in pages:
            self.owner.pop(page, None)
        return freed


class SimKV:
    def __init__(self, ledger: Ledger, instance: Any, page_bytes: int, *, room_of_pages: Any = None,
                 allocator: RecordingAllocator | None = None):
        self.ledger, self.instance, self.page_bytes = ledger, instance, page_bytes
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

    def gathers_progressively(self, owner: Any) -> bool:
        return False

    def publish_while_gathering(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the simulated transfer is not progressive")

    def discard(self, staging: SimBuffer) -> None:
        self.ledger.free(staging.kind, staging.key, by="the handler discarding it")

    # --- decode ---
    def stream(self, pages: list[int]) -> None:
        return None

    def complete_stream(self, stream: Any, staging: SimBuffer) -> bool:
        return False

    def scatter(self, owner: Any, pieces: tuple[SimBuffer, ...], pages: list[int], stream: Any, plan: Any) -> None:
        self.ledger.writes += 1
        room = pieces[0].room
        for page in pages:
            holder = self.allocator.owner.get(page)
            if holder != room or any(piece.room != room for piece in pieces):
                whose = "nobody" if holder is None else f"room {holder}"
                self.ledger.violation(f"a write of room {room} reached page {page}, held by {whose} "
                                      "(after its FreePages)")

    def cancel(self, stream: Any) -> None:
        pass
