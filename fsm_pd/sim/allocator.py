"""The simulated page allocator: the real ``PageAllocator``, with every reservation and every free attempt written to
the ledger, a page -> room map for the read and write checks, and each page's unfinished writer and readers: a page may
go back to the free list only once they have all finished.

Pages carry content tags (``last_writer``: the room whose prefill computed each): a gather or a send copies them, a
pull carries them, a write into D's pages stores them (``check_write``), and both KV checksums hash them
(``kv.py``). ``accounting`` checks that every page is exactly one of free, a room's or the prefix cache's, and that
the real allocator's own record says the same (no page held by two rooms).

A pool both engines of one process share (``shared_pool.py``) is one ``RecordingAllocator`` under the production
``AllocatorView`` of each role: its room keys are then ``(role, room)``, and ``members`` names the process instance
of each role. Its ``hand_over`` (a handoff that moves page ownership) is the real one, checked as it happens.
"""

from __future__ import annotations

from typing import Any

from fsm_pd.kvpool.pages import PageAllocator
from fsm_pd.sim.ledger import Ledger


def room_id(room: Any) -> Any:
    """A room's own id from a key of this allocator: a shared pool's views key their rooms ``(role, room)``."""
    return room[1] if isinstance(room, tuple) else room


class RecordingAllocator(PageAllocator):
    def __init__(self, num_pages: int, ledger: Ledger, instance: Any):
        super().__init__(num_pages)
        self.ledger, self.instance = ledger, instance
        self.members: dict[str, Any] = {}  # a shared pool: the instance of each role whose view keys rooms here
        self.owner: dict[int, Any] = {}  # page -> room (key) holding it
        # page -> rooms whose live request uses it from the prefix cache (recorded by the simulation, not the cache)
        self.in_use: dict[int, list[int]] = {}
        # page -> who has not finished with it: its writer (a prefill chunk, a streamed scatter) and its readers (a
        # send from the pool): none may be left when the page goes back to the free list
        self.busy: dict[int, list[str]] = {}
        self.final: set[int] = set()  # pages whose holder's KV is written (a prefill chunk done, a scatter landed)
        self.last_writer: dict[int, int] = {}  # page -> the room whose KV it holds (who wrote it last)

    @property
    def name(self) -> str:
        return "+".join(m.name for m in self.members.values()) or self.instance.name

    def _who(self, room: Any) -> tuple[Any, Any]:
        """The process instance a room key belongs to, and the room's own id."""
        if isinstance(room, tuple):
            return self.members[room[0]], room[1]
        return self.instance, room

    # --- what the simulation saw the requests take and let go ---
    def use(self, pages: tuple[int, ...], room: int) -> None:
        for page in pages:
            self.in_use.setdefault(page, []).append(room)

    def unuse(self, pages: tuple[int, ...], room: int) -> None:
        for page in pages:
            users = self.in_use[page]
            users.remove(room)
            if not users:
                del self.in_use[page]

    # --- who is still writing or reading a page ---
    def begin(self, pages: list[int] | tuple[int, ...], who: str) -> None:
        for page in pages:
            self.busy.setdefault(page, []).append(who)

    def end(self, pages: list[int] | tuple[int, ...], who: str) -> None:
        for page in pages:
            users = self.busy.get(page)
            if users is not None and who in users:
                users.remove(who)
                if not users:
                    del self.busy[page]

    def wrote(self, room: int, pages: list[int] | tuple[int, ...]) -> None:
        """``room``'s KV is now final in ``pages``."""
        for page in pages:
            self.final.add(page)
            self.last_writer[page] = room

    def _returning(self, pages: list[int], how: str, room: Any = None) -> None:
        """``pages`` go back to the free list: their writer and every reader must have finished, and those a room
        frees must be its own (a page another room adopted meanwhile is not: freeing it would free it under that
        room)."""
        for page in pages:
            if room is not None and self.owner.get(page) != room:
                self.ledger.violation(f"{self.name}: page {page} went back to the free list ({how}), but room "
                                      f"{self.owner.get(page)} holds it")
            if self.busy.get(page):
                self.ledger.violation(f"{self.name}: page {page} went back to the free list ({how}) while "
                                      f"{' and '.join(self.busy[page])} had not finished")
            self.final.discard(page)

    def check_read(self, room: int, pages: list[int] | tuple[int, ...], what: str) -> bool:
        """A read of ``room``'s KV from ``pages`` (a gather, a send from the pool): each must still be ``room``'s
        (or a cached prefix it uses) and hold final KV. False if the bytes read are not the room's."""
        good = True
        for page in pages:
            holder = self.owner.get(page)
            mine = holder == room or room in self.in_use.get(page, ())
            if not mine:
                whose = "nobody" if holder is None else f"room {holder}"
                writer = self.last_writer.get(page)
                self.ledger.violation(f"{self.name}: {what} of room {room} read page {page}, held by {whose}"
                                      f" and last written by room {writer}")
                good = False
            elif page not in self.final:
                self.ledger.violation(f"{self.name}: {what} of room {room} read page {page} before its KV "
                                      f"was final (being written by {self.busy.get(page) or 'nobody yet'})")
                good = False
        return good

    # --- the allocator, recorded and checked ---
    def reserve(self, room: int, count: int) -> list[int]:
        pages = super().reserve(room, count)
        instance, own = self._who(room)
        self.ledger.alloc("pages", (instance.name, own), instance, own)
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
                self.ledger.violation(f"{self.name}: page {page} handed to room {room}, but room "
                                      f"{self.owner[page]} holds it")
            if page in self.in_use:
                self.ledger.violation(f"{self.name}: page {page} handed to room {room} while the cached "
                                      f"prefix of live room(s) {self.in_use[page]} uses it")
            if page in cached:
                self.ledger.violation(f"{self.name}: page {page} handed to room {room} while the prefix "
                                      "cache holds it")
            self.owner[page] = room
            self.final.discard(page)

    def adopt(self, room: int, pages: list[int]) -> None:
        super().adopt(room, pages)
        for page in pages:
            self.owner.pop(page, None)

    def release(self, pages: list[int]) -> None:
        for page in pages:
            if page in self.in_use:
                self.ledger.violation(f"{self.name}: the prefix cache freed page {page}, which the cached "
                                      f"prefix of live room(s) {self.in_use[page]} uses")
        self._returning(pages, "the prefix cache evicting it")
        super().release(pages)

    def free(self, room: int) -> int:
        pages = self.pages_of(room)
        self._returning(pages, f"room {room}'s free", room)
        freed = super().free(room)
        instance, own = self._who(room)
        self.ledger.free("pages", (instance.name, own), by="the room's free")
        for page in pages:
            self.owner.pop(page, None)
        return freed

    def give_back(self, room: int) -> int:
        """A retracted sequence's pages go back; the room stays open (it reserves again when it resumes)."""
        pages = self.pages_of(room)
        self._returning(pages, f"room {room} retracted", room)
        given = super().give_back(room)
        for page in pages:
            self.owner.pop(page, None)
        return given

    def hand_over(self, pages: list[int], replacing: list[int], *, sender: object) -> tuple[object, object]:
        """The real hand-over (a shared pool's handoff: ``SimPoolKV.scatter``), then checked: the pages came from the
        prefill room of the receiving room's id, each holds that room's final KV and has no writer or reader left on
        it; they are the receiver's alone now, and what it gave back is free. A refused hand-over
        (``PageOwnershipError``) changed nothing, and is the handlers' to report."""
        src, dst = super().hand_over(pages, replacing, sender=sender)
        room = room_id(dst)
        if src != ("prefill", room):
            self.ledger.violation(f"{self.name}: decode room {room} adopted pages {pages[:4]} from {src}, not from "
                                  f"prefill room {room}")
        for page in pages:
            if self.owner.get(page) != src:
                self.ledger.violation(f"{self.name}: page {page} handed over from {src}, which the record says "
                                      f"{self.owner.get(page)} held")
            if page not in self.final or self.last_writer.get(page) != room:
                kv = "final KV" if page in self.final else "no final KV"
                self.ledger.violation(f"{self.name}: decode room {room} adopted page {page}, which holds {kv} of room "
                                      f"{self.last_writer.get(page)}, not the KV prefill room {room} computed")
            if self.busy.get(page):
                self.ledger.violation(f"{self.name}: page {page} handed over while {' and '.join(self.busy[page])} "
                                      "had not finished")
            self.owner[page] = dst
        self._returning(replacing, f"replaced by the pages decode room {room} adopted", dst)
        for page in replacing:
            self.owner.pop(page, None)
        holders = [holder for holder, held in self._held.items() if holder != dst and set(held) & set(pages)]
        if holders or not set(pages) <= set(self._held.get(dst, ())):
            self.ledger.violation(f"{self.name}: after the hand-over, pages {pages[:4]} are not {dst}'s alone (also "
                                  f"held by: {holders})")
        free = set(self._free)
        if not set(replacing) <= free or set(pages) & free:
            self.ledger.violation(f"{self.name}: after the hand-over to {dst}, its replaced pages "
                                  f"{sorted(set(replacing) - free)[:4]} are not free, or adopted pages "
                                  f"{sorted(set(pages) & free)[:4]} are")
        return src, dst

    def accounting(self) -> list[str]:
        """Every page is exactly one of: free, a room's, the cache's; and the cache's lock counts are the live
        requests' uses. Meaningful when no step or callback is under way."""
        name, found = self.name, []
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
        held: dict[int, Any] = {}  # the real allocator's own record: each page one room's at most, the recorded one
        for holder, pages in self._held.items():
            for page in pages:
                if page in held:
                    found.append(f"{name}: page {page} is held by {held[page]} and {holder} at once")
                held[page] = holder
        if held != self.owner:
            wrong = sorted(p for p in set(held) | owned if held.get(p) != self.owner.get(p))[:3]
            found.append(f"{name}: the allocator says pages {wrong} are held by {[held.get(p) for p in wrong]}, the "
                         f"record {[self.owner.get(p) for p in wrong]}")
        locks = cache.lock_counts() if cache is not None else {}
        for page in sorted(set(locks) | set(self.in_use)):
            users = self.in_use.get(page, [])
            if locks.get(page, 0) != len(users):
                found.append(f"{name}: cached page {page} is locked {locks.get(page, 0)} times, used by live "
                             f"room(s) {users}")
        return found

    def check_write(self, room: int, pages: list[int], what: str, content: tuple = (), transfer: bool = True,
                    writer: str | None = None) -> None:
        """A write of ``room``'s KV reaches ``pages``: each must still be held by ``room``. ``content``: the tags of
        what is written (``SimBuffer.content``), which the pages hold from now on. No other writer or reader may be
        on a page (``writer``: the caller's own ``begin``)."""
        self.ledger.writes += transfer  # counts the writes of handoffs (a decode step's are not)
        for index, page in enumerate(pages):
            holder = self.owner.get(page)
            if holder != room:
                whose = "nobody" if holder is None else f"room {holder}"
                self.ledger.violation(f"{what} of room {room} reached page {page}, held by {whose} "
                                      "(after its FreePages)")
            elif [who for who in self.busy.get(page, ()) if who != writer]:
                self.ledger.violation(f"{self.name}: {what} of room {room} wrote page {page} while "
                                      f"{' and '.join(w for w in self.busy[page] if w != writer)} had not finished")
            else:
                self.final.add(page)
                self.last_writer[page] = content[index] if index < len(content) else room_id(room)
