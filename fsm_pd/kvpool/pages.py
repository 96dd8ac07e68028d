"""The KV page allocator: which pages of the pool belong to which room.

Page 0 is the reserved padding page and is never handed out. A room holds at most one reservation; freeing a room
that holds nothing is a no-op (effects are idempotent), and a room that was freed cannot reserve again, so a
reservation that completes after its room already failed is refused instead of leaking. That memory of freed rooms
is for races between a free and a reservation already under way, so it is short: the last ``remember_closed``
rooms (``forget`` drops one earlier, once its id cannot come back). Reuse of a room id long after is refused by the
journal, not here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Protocol


def pages_for(num_tokens: int, page_size: int) -> int:
    """How many pages hold ``num_tokens`` positions (the last one may be partly filled)."""
    return -(-num_tokens // page_size)


class OutOfPages(Exception):
    """Not enough free pages now; the caller may queue and retry when pages are freed."""


REMEMBER_CLOSED = 4096  # freed rooms kept to refuse a late reservation; far more than can be in flight at once


class Reclaimer(Protocol):
    """Who holds pages that are neither free nor a room's, and gives them back on demand: the prefix cache."""

    def reclaimable(self) -> int: ...

    def reclaim(self, count: int) -> int: ...


class PageAllocator:
    def __init__(self, num_pages: int, remember_closed: int = REMEMBER_CLOSED):
        if num_pages < 2:
            raise ValueError("num_pages must be at least 2 (page 0 is reserved)")
        if remember_closed < 1:
            raise ValueError("remember_closed must be at least 1")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._held: dict[int, list[int]] = {}
        # page -> the room in ``_held`` that holds it: who holds a handoff's pages is asked of it page by page, not
        # of every room in turn (a set of each room's pages until one covered them: 116 us for 64 pages beside 16
        # decoding streams, twice a --role pd handoff, on the model thread)
        self._owner: dict[int, object] = {}
        self._closed: OrderedDict[int, None] = OrderedDict()  # recently freed rooms, oldest first
        self._remember_closed = remember_closed
        self._lock = threading.Lock()
        self._cached = 0  # pages the reclaimer (the prefix cache) adopted from rooms and has not released
        self.reclaimer: Reclaimer | None = None
        self.reservations = 0
        self.frees = 0

    @property
    def free_pages(self) -> int:
        """Pages a reservation can take now: the free list, and whatever the prefix cache would give back."""
        return len(self._free) + (self.reclaimer.reclaimable() if self.reclaimer is not None else 0)

    @property
    def reserved_pages(self) -> int:
        """Pages rooms hold (not the prefix cache's)."""
        return self.num_pages - 1 - len(self._free) - self._cached

    @property
    def cached_pages(self) -> int:
        return self._cached

    def holders(self) -> dict[int, int]:
        """Room → number of pages it holds."""
        with self._lock:
            return {room: len(pages) for room, pages in self._held.items()}

    def reserve(self, room: int, count: int) -> list[int]:
        """Give ``room`` ``count`` pages; raises :class:`OutOfPages` if there are not enough free right now."""
        if count < 1:
            raise ValueError(f"a reservation needs at least one page, got {count}")
        if count > self.num_pages - 1:
            raise ValueError(f"{count} pages can never fit in a pool of {self.num_pages - 1} usable pages")
        self._make_room(count)
        with self._lock:
            if room in self._held:
                raise ValueError(f"room {room} already holds pages")
            if room in self._closed:
                raise ValueError(f"room {room} was already freed; it cannot reserve again")
            if count > len(self._free):
                raise OutOfPages(f"room {room} needs {count} pages, {len(self._free)} free")
            pages = [self._free.popleft() for _ in range(count)]
            self._held[room] = pages
            self._owner.update(dict.fromkeys(pages, room))
            self.reservations += 1
            return list(pages)  # a copy: the caller must not be able to edit the record

    def extend(self, room: int, count: int) -> list[int]:
        """Append ``count`` pages to ``room``'s reservation (a decoding sequence grows a page every ``page_size``
        tokens), making one if it holds none; all or nothing. Returns the new pages."""
        if count < 1:
            raise ValueError(f"extending needs at least one page, got {count}")
        self._make_room(count)
        with self._lock:
            if room in self._closed:
                raise ValueError(f"room {room} was already freed; it cannot grow")
            if count > len(self._free):
                raise OutOfPages(f"room {room} needs {count} more pages, {len(self._free)} free")
            pages = [self._free.popleft() for _ in range(count)]
            if room not in self._held:
                self.reservations += 1
            self._held.setdefault(room, []).extend(pages)
            self._owner.update(dict.fromkeys(pages, room))
            return list(pages)

    def _make_room(self, count: int) -> None:
        """Have the reclaimer evict what the free list lacks for ``count`` pages (outside the lock: it releases)."""
        short = count - len(self._free)
        if short > 0 and self.reclaimer is not None:
            self.reclaimer.reclaim(short)

    def adopt(self, room: int, pages: list[int]) -> None:
        """``pages`` of ``room``'s reservation now belong to the reclaimer: they leave the room and do not come back
        with its ``free``, but with ``release``."""
        if not pages:
            return
        with self._lock:
            held = self._held.get(room, [])
            taken = set(pages)
            if not taken <= set(held):
                raise ValueError(f"room {room} does not hold pages {sorted(taken - set(held))}")
            rest = [p for p in held if p not in taken]
            if rest:
                self._held[room] = rest
            else:
                self._held.pop(room, None)
            for page in taken:
                del self._owner[page]
            self._cached += len(taken)

    def release(self, pages: list[int]) -> None:
        """The reclaimer gives adopted ``pages`` back: they are free again."""
        with self._lock:
            if len(pages) > self._cached:
                raise ValueError(f"{len(pages)} pages released, only {self._cached} were adopted")
            self._free.extend(pages)
            self._cached -= len(pages)

    def pages_of(self, room: int) -> list[int]:
        with self._lock:
            return list(self._held.get(room, ()))

    def free(self, room: int) -> int:
        """Return the room's pages to the pool; returns how many (0 if it held none)."""
        with self._lock:
            self._closed[room] = None
            self._closed.move_to_end(room)
            if len(self._closed) > self._remember_closed:
                self._closed.popitem(last=False)
            return self._release(room)

    def give_back(self, room: int) -> int:
        """Return the room's pages to the pool but keep the room open: a retracted sequence reserves again when it
        resumes (``free`` would refuse that). Returns how many pages came back."""
        with self._lock:
            return self._release(room)

    def _release(self, room: int) -> int:
        pages = self._held.pop(room, None)
        if not pages:
            return 0
        for page in pages:
            del self._owner[page]
        self._free.extend(pages)
        self.frees += 1
        return len(pages)

    def reset_order(self) -> bool:
        """Put the free pages back in their starting order (1, 2, ...) when no room or cache holds any; False
        otherwise.

        Pages freed in the order requests end come back scattered; an idle node can start again from a fresh
        pool's order (``/flush_cache``). The memory of freed rooms stays: it still guards late reservations."""
        with self._lock:
            if self._held or self._cached:
                return False
            self._free = deque(range(1, self.num_pages))
            return True

    def forget(self, room: int) -> None:
        """Drop the memory that ``room`` was freed (once its id can no longer come back)."""
        with self._lock:
            self._closed.pop(room, None)

    def holder(self, pages: list[int]) -> object:
        """The room that holds every page of ``pages`` now (``PageOwnershipError`` if none does): what a handoff
        names as its sender when it names the pages (``hand_over``)."""
        with self._lock:
            return self._holder_of(pages, "handed over")

    def hand_over(self, pages: list[int], replacing: list[int], *, sender: object) -> tuple[object, object]:
        """Move ``pages`` from ``sender`` (the room that held them when the handoff named them: ``holder``) to the
        one that holds ``replacing``, whose pages ``replacing`` go back to the free list: ownership changes hands and
        no byte moves (``--role pd`` on one pool, ``docs/tpu.md``). All or nothing, under the lock, so a page is never
        owned twice nor freed while it moves: where ``sender`` no longer holds every page of ``pages`` (its deadline
        or an abort ran first and freed them; another room may hold them by now, with its own KV) or the receiver's
        room no longer holds ``replacing``, it raises ``PageOwnershipError`` and changes nothing. Returns (from, to).
        """
        with self._lock:
            owner = self._owner
            if not (pages and sender in self._held and len(set(pages)) == len(pages)
                    and list(map(owner.get, pages)).count(sender) == len(pages)):
                now = self._holder_of(pages, "handed over")  # raises if nobody holds them (freed meanwhile)
                raise PageOwnershipError(f"the pages room {sender!r} handed over ({sorted(pages)[:8]}...) are room "
                                         f"{now!r}'s now: freed and reused meanwhile")
            src, dst = sender, self._holder_of(replacing, "replaced")
            if src == dst:
                raise PageOwnershipError(f"room {src!r} cannot hand pages over to itself")
            moving, going = set(pages), set(replacing)
            rest = [p for p in self._held[src] if p not in moving]
            if rest:
                self._held[src] = rest
            else:
                del self._held[src]
            kept = [p for p in self._held[dst] if p not in going]
            self._held[dst] = kept + list(pages)
            for page in replacing:
                del owner[page]
            owner.update(dict.fromkeys(pages, dst))
            self._free.extend(replacing)
            return src, dst

    def _holder_of(self, pages: list[int], what: str) -> object:
        """The one room that holds every page of ``pages`` (under the lock)."""
        wanted = set(pages)
        if not wanted or len(wanted) != len(pages):
            raise PageOwnershipError(f"pages to be {what} must be distinct and at least one: {pages[:8]}")
        owner = self._owner
        room = owner.get(pages[0])
        if room is not None and list(map(owner.get, pages)).count(room) == len(pages):
            return room
        raise PageOwnershipError(f"no room holds all of the pages to be {what} ({sorted(wanted)[:8]}...): freed "
                                 "or reused meanwhile")

    def view(self, tag: str) -> AllocatorView:
        """This allocator under room keys of one role's own (``(tag, room)``): two engines that share one pool (a
        prefill and a decode engine of ``--role pd``) both key their pages by room id, and must not collide."""
        return AllocatorView(self, tag)


class PageOwnershipError(ValueError):
    """A handoff found the pages it was to move not where it expected them."""


class AllocatorView:
    """One role's keys on a shared ``PageAllocator``: the same pages, free list and counts, its rooms apart."""

    def __init__(self, allocator: PageAllocator, tag: str) -> None:
        self.shared, self.tag = allocator, tag

    def _key(self, room):
        return (self.tag, room)

    num_pages = property(lambda self: self.shared.num_pages)
    free_pages = property(lambda self: self.shared.free_pages)
    reserved_pages = property(lambda self: self.shared.reserved_pages)
    cached_pages = property(lambda self: self.shared.cached_pages)
    reservations = property(lambda self: self.shared.reservations)
    frees = property(lambda self: self.shared.frees)

    @property
    def reclaimer(self) -> Reclaimer | None:
        return self.shared.reclaimer

    @reclaimer.setter
    def reclaimer(self, value: Reclaimer | None) -> None:
        if self.shared.reclaimer is not None and value is not None and self.shared.reclaimer is not value:
            raise ValueError("a shared pool takes one prefix cache, and it has one")
        self.shared.reclaimer = value

    def holders(self) -> dict:
        return {key[1]: n for key, n in self.shared.holders().items() if isinstance(key, tuple) and key[0] == self.tag}

    def reserve(self, room, count: int) -> list[int]:
        return self.shared.reserve(self._key(room), count)

    def extend(self, room, count: int) -> list[int]:
        return self.shared.extend(self._key(room), count)

    def adopt(self, room, pages: list[int]) -> None:
        self.shared.adopt(self._key(room), pages)

    def release(self, pages: list[int]) -> None:
        self.shared.release(pages)

    def pages_of(self, room) -> list[int]:
        return self.shared.pages_of(self._key(room))

    def free(self, room) -> int:
        return self.shared.free(self._key(room))

    def give_back(self, room) -> int:
        return self.shared.give_back(self._key(room))

    def reset_order(self) -> bool:
        return self.shared.reset_order()

    def forget(self, room) -> None:
        self.shared.forget(self._key(room))

    def holder(self, pages: list[int]) -> object:
        return self.shared.holder(pages)

    def hand_over(self, pages: list[int], replacing: list[int], *, sender: object) -> tuple[object, object]:
        return self.shared.hand_over(pages, replacing, sender=sender)
