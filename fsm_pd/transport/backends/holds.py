"""P-side bookkeeping shared by every backend: which published entries still pin memory, and why ended ones ended.

A hold ends exactly once — released (D said PULLED), failed (P gave up), expired (nobody pulled in time) or closed —
and at that moment the backend's ``retire`` hook replaces the entry with a tombstone so that a late or duplicate
pull fails fast with the reason instead of hanging, and the staging memory is freed. Tombstones are remembered for
a while so that a uuid is never published twice.

How long depends on how the hold ended. A failed or expired entry is what a puller may still be waiting for, so its
tombstone lasts ``tombstone_ttl_s`` (up to ``max_tombstones``); these are rare. A released one was pulled and
acknowledged by its only consumer, and every request ends that way: its tombstone joins a short list of the last
``max_released`` (a duplicate pull comes within moments), or the table would grow with the request rate times the
TTL (issue 11's soak). A uuid is drawn at random from 2**63, so forgetting it risks no reuse.

Time comes from a ``HoldClock`` (``now`` and ``call_at``): the real backends pass the process's deadline scheduler
(``timers.scheduler()``, monotonic time on its own thread), the simulation its virtual clock, so the hold expiries
and tombstone TTLs it runs are this code's.

``PullWaits`` is the other half, what a producer that serves pulls on threads of its own (the ``device`` and ``tcp``
backends) keeps beside its table: the pulls parked until their uuid is published, and the one delivery each entry
allows until its hold ends.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fsm_pd.transport.backends.base import PRODUCER_FAILED, OpenEntries, TransferBackend, check_uuid
from fsm_pd.transport.backends.timers import scheduler

T = TypeVar("T")


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class HoldClock(Protocol):
    """What a ``HoldTable`` needs of time: the present, and a callback at a later instant of the same clock."""

    def now(self) -> float: ...

    def call_at(self, when: float, fn: Callable[[], None]) -> Cancellable: ...


@dataclass(slots=True, eq=False)
class Hold:
    uuid: int
    nbytes: int
    deadline: float  # on the table's clock
    payload: Any  # whatever the backend registered; the reference that keeps the memory alive
    timer: Cancellable | None = field(default=None, repr=False)


# retire(uuid, reason, hold or None): called once per ended uuid, under the table lock.
RetireHook = Callable[[int, str, "Hold | None"], None]


class HoldTable:
    def __init__(
        self,
        retire: RetireHook,
        *,
        tombstone_ttl_s: float = 600.0,
        max_tombstones: int = 65536,
        max_released: int = 1024,
        clock: HoldClock | None = None,
    ) -> None:
        """``clock``: where ``now`` and the expiry callbacks come from (default: the process's deadline scheduler)."""
        self._retire = retire
        self._tombstone_ttl_s = tombstone_ttl_s
        self._max_tombstones = max_tombstones
        self._max_released = max_released
        self._clock = clock if clock is not None else scheduler()
        # Reentrant: backends call table methods from inside their own hooks (e.g. a server thread reading a hold).
        self.lock = threading.RLock()
        self._holds: dict[int, Hold] = {}
        self._tombstones: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._released: OrderedDict[int, str] = OrderedDict()  # the last released uuids, oldest first
        self._closed = False

    def publish(self, uuid: int, nbytes: int, hold_timeout_s: float, expose: Callable[[float], Any]) -> Hold:
        """Record a hold; ``expose(deadline)`` makes the entry pullable and returns what keeps it alive.

        ``expose`` runs under the lock, so an expiry or ``fail`` can never overtake the registration.
        """
        check_uuid(uuid)
        if not hold_timeout_s > 0:
            raise ValueError(f"hold_timeout_s must be positive, got {hold_timeout_s!r}")
        with self.lock:
            if self._closed:
                raise RuntimeError("backend is closed")
            if uuid in self._holds or uuid in self._tombstones or uuid in self._released:
                raise ValueError(f"uuid {uuid} was already published on this node; transfer ids are never reused")
            deadline = self._clock.now() + hold_timeout_s
            hold = Hold(uuid, nbytes, deadline, expose(deadline))
            self._holds[uuid] = hold
            hold.timer = self._clock.call_at(
                deadline, lambda: self.end(uuid, f"hold expired after {hold_timeout_s:g} s without a pull")
            )
            return hold

    def end(self, uuid: int, reason: str, *, unpublished_too: bool = False, released: bool = False) -> bool:
        """End the hold of ``uuid`` (no-op if already ended). With ``unpublished_too``, tombstone an unknown uuid.
        ``released``: its consumer has it (a short memory suffices, see the module's doc)."""
        with self.lock:
            hold = self._holds.pop(uuid, None)
            if hold is None and (uuid in self._tombstones or uuid in self._released or not unpublished_too):
                return False
            if hold is not None and hold.timer is not None:
                hold.timer.cancel()
            if released:
                self._released[uuid] = reason
                if len(self._released) > self._max_released:
                    self._released.popitem(last=False)
            else:
                self._remember(uuid, reason)
            self._retire(uuid, reason, hold)
            return True

    def get(self, uuid: int) -> Hold | None:
        with self.lock:
            return self._holds.get(uuid)

    def lookup(self, uuid: int) -> tuple[Any, str | None]:
        """``(payload, None)`` for a live hold, ``(None, reason)`` for an ended one, ``(None, None)`` if unknown."""
        with self.lock:
            hold = self._holds.get(uuid)
            return (hold.payload, None) if hold is not None else (None, self.tombstone(uuid))

    def tombstone(self, uuid: int) -> str | None:
        """Why ``uuid`` ended, if it did (and is still remembered)."""
        with self.lock:
            entry = self._tombstones.get(uuid)
            return entry[0] if entry else self._released.get(uuid)

    def remembered(self) -> int:
        """Tombstones held now (both kinds)."""
        with self.lock:
            return len(self._tombstones) + len(self._released)

    def open_entries(self) -> OpenEntries:
        with self.lock:
            return OpenEntries(len(self._holds), sum(h.nbytes for h in self._holds.values()))

    def close(self, reason: str = "producer closed") -> None:
        with self.lock:
            self._closed = True
            for uuid in list(self._holds):
                self.end(uuid, reason)

    def _remember(self, uuid: int, reason: str) -> None:
        now = self._clock.now()
        self._tombstones[uuid] = (reason, now)
        self._tombstones.move_to_end(uuid)
        while self._tombstones:
            oldest, (_, at) = next(iter(self._tombstones.items()))
            if len(self._tombstones) <= self._max_tombstones and now - at < self._tombstone_ttl_s:
                break
            del self._tombstones[oldest]


class HoldingBackend(TransferBackend):
    """A backend whose published entries live in a ``HoldTable`` (``self._holds``): release, fail and accounting
    are the same for all of them; each backend says in ``_retire`` what ending an entry means for its transport."""

    _holds: HoldTable

    def release(self, uuid: int) -> None:
        self._holds.end(uuid, "released after the pull", released=True)

    def fail(self, uuid: int, reason: str) -> None:
        check_uuid(uuid)
        self._holds.end(uuid, f"{PRODUCER_FAILED}: {reason}", unpublished_too=True)

    def open_entries(self) -> OpenEntries:
        return self._holds.open_entries()


class PullWaits:
    """Pulls waiting on a producer's entries, and the entries already delivered: every method but ``parked`` runs
    under ``changed``'s lock (the ``HoldTable``'s), whose ``notify_all`` on each publish, end and close wakes the
    waiters.

    - A pull whose uuid is not published yet *parks* (``wait``) until it is, it ends, or the pull's deadline passes;
      ``parked`` says which uuids have a pull parked (``TransferBackend.parked_pulls``: what the tests wait for
      before they publish).
    - An entry is delivered once (``deliver``): a second pull of it fails until its hold ends (``ended``), when a
      new publish of that uuid could be delivered again.
    """

    def __init__(self, changed: threading.Condition) -> None:
        self._changed = changed
        self._parked: Counter[int] = Counter()
        self._delivered: set[int] = set()

    def wait(self, uuid: int, deadline: float, published: Callable[[], T | None],
             stopped: Callable[[], bool] = lambda: False) -> T | None:
        """``published()`` once it gives the entry (it raises for one that ended), parked until then; None once
        ``deadline`` (``time.monotonic``) has passed or ``stopped()``."""
        parked = False
        try:
            while True:
                found = published()
                if found is not None:
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0 or stopped():
                    return None
                if not parked:
                    self._parked[uuid] += 1
                    parked = True
                self._changed.wait(remaining)
        finally:
            if parked:
                self._parked[uuid] -= 1
                if not self._parked[uuid]:
                    del self._parked[uuid]

    def delivered(self, uuid: int) -> bool:
        """Whether ``uuid`` was delivered and its hold has not ended since."""
        return uuid in self._delivered

    def deliver(self, uuid: int) -> None:
        self._delivered.add(uuid)

    def ended(self, uuid: int) -> None:
        """``uuid``'s hold ended: a new publish of it would be a new delivery."""
        self._delivered.discard(uuid)

    def parked(self) -> frozenset[int]:
        with self._changed:
            return frozenset(self._parked)
