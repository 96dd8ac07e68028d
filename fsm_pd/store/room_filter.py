"""Which rooms a journal may hold, answered without asking the database: a Bloom filter over (node, role, room).

``Journal.has_room`` runs on every request a PD engine takes (a room is used once, ever, so a new room is checked
against the journal's history). Through SQLite it was a query on the event loop's thread, and the driver lets go of
the interpreter's lock for it: under load the thread then waits up to the switch interval to get the lock back from
the model thread (py-spy put two thirds of a pd engine's ``submit`` there). Beside a busy thread, a question
about a new room took 63-110 us through the database and 3-5 us through this filter (``has_room`` 1,000 times, 2
cores); what the writer pays to feed it, a handoff's 6 rows buffered, went from 2-5 us to 9-15. Almost every room
asked about is new, so a filter that says
"surely not" for nearly all of them, and "maybe" (the database decides) for the rest, takes it off the path.

No false "surely not": every room the journal holds is in the filter, those journaled before it opened (read on a
thread of their own; until then every question goes to the database) and every row added since. Past the size it
was made for, more questions go to the database (about 1 in 100 at its size, 1 in 7 at twice it), none wrongly
answered.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

PROBES = 4  # bits set per key: at 10 bits a key 1.2% false "maybe" (7, the optimum, 0.8%, costs the writer more)
BITS_PER_KEY = 10
MIN_KEYS = 1 << 20  # 1.25 MiB of bits


class RoomFilter:
    def __init__(self, load: Callable[[], Iterable[tuple[str, str, int]]], pending: Iterable[tuple] = ()):
        """``load()`` yields every (node, role, room) the database holds; it runs on a thread started here.
        ``pending``: the keys of rows not yet written there (each row's first three columns)."""
        self._lock = threading.Lock()
        self._size = MIN_KEYS * BITS_PER_KEY
        self._bits = bytearray(self._size // 8)
        self._added: list[tuple] | None = [tuple(key[:3]) for key in pending]  # set again once the database is read
        self.ready = threading.Event()  # until set, ``maybe`` answers True: the database decides
        self.failed: BaseException | None = None
        threading.Thread(target=self._fill, args=(load,), name="journal-rooms", daemon=True).start()

    def add(self, node: str, role: str, room: int) -> None:
        self.add_many(((node, role, room),))

    def add_many(self, keys: Iterable[tuple[str, str, int]]) -> None:
        """Set each key once (a batch of rows names the same rooms again and again): the journal's writer pays
        this for every row it buffers, on the thread that steps the rooms."""
        keys = set(keys)
        with self._lock:
            if self._added is not None:
                self._added.extend(keys)
            for key in keys:
                self._set(key)

    def maybe(self, node: str, role: str, room: int) -> bool:
        """False only where the journal surely holds no row of ``room`` for ``node`` in ``role``."""
        if not self.ready.is_set():
            return True
        bits = self._bits
        return all(bits[p >> 3] & (1 << (p & 7)) for p in self._positions((node, role, room)))

    def _positions(self, key: tuple[str, str, int]) -> list[int]:
        h = hash(key) & 0xFFFFFFFFFFFFFFFF
        step = (h >> 32) | 1  # double hashing: probe i at h + i * step
        return [(h + i * step) % self._size for i in range(PROBES)]

    def _set(self, key: tuple[str, str, int]) -> None:
        for p in self._positions(key):
            self._bits[p >> 3] |= 1 << (p & 7)

    def _fill(self, load: Callable[[], Iterable[tuple[str, str, int]]]) -> None:
        try:
            keys = list(load())
        except BaseException as exc:  # noqa: BLE001 - the database keeps answering: the filter stays not ready
            self.failed = exc
            return
        with self._lock:
            added, self._added = self._added or [], None
            self._size = max(MIN_KEYS, 2 * (len(keys) + len(added))) * BITS_PER_KEY  # room for as many again
            self._bits = bytearray(self._size // 8)
            for key in (*keys, *added):
                self._set(key)
        self.ready.set()
