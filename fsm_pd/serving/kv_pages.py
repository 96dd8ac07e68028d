"""The serving side's page allocator: ``PageAllocator`` plus ``extend``, so a decoding sequence can grow.

``PageAllocator`` gives a room one reservation, which fits a transfer (the prompt's pages, known up front) but not
decoding, where a sequence needs one more page every ``page_size`` tokens. ``extend`` appends pages to the room's
existing reservation, so prompt and generated tokens live under one key and one ``free`` returns them all. Keeping
one allocator (rather than a second pool for growth) is what lets admission see every page that is in use.
"""

from __future__ import annotations

from fsm_pd.engine.pages import OutOfPages, PageAllocator


def pages_for(num_tokens: int, page_size: int) -> int:
    """How many pages hold ``num_tokens`` positions."""
    return -(-num_tokens // page_size)


class GrowingPageAllocator(PageAllocator):
    def reserve(self, room: int, count: int) -> list[int]:
        # PageAllocator returns the very list it keeps; a caller that extends its copy would corrupt the record
        return list(super().reserve(room, count))

    # Reaches into PageAllocator's private state under its own lock; the natural home of this method is
    # fsm_pd/engine/pages.py, which this package does not own.
    def extend(self, room: int, count: int) -> list[int]:
        """Append ``count`` pages to ``room``'s reservation (making one if it holds none); all or nothing."""
        if count < 1:
            raise ValueError(f"extending needs at least one page, got {count}")
        with self._lock:
            if room in self._closed:
                raise ValueError(f"room {room} was already freed; it cannot grow")
            if count > len(self._free):
                raise OutOfPages(f"room {room} needs {count} more pages, {len(self._free)} free")
            pages = [self._free.popleft() for _ in range(count)]
            if room not in self._held:
                self.reservations += 1
            self._held.setdefault(room, []).extend(pages)
            return list(pages)
