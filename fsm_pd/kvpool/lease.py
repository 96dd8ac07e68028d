"""``PoolLease``: other threads may read the KV pool's bytes between the model thread's jobs, never during one.

Why: a prefill node sends a request's pages to the decode node straight from the pool, with no gather copy
(``kernels/page_source.py``). A NumPy view of a pool layer is zero-copy on CPU, but a view alive while a job donates
the pool makes the donation fail: XLA then copies the whole pool in that step, and the view reads the old buffer.
So a reader holds the lease only while it reads (one non-blocking ``sendmsg`` of a few MiB) and drops every view
before it lets go, and the model thread takes the lease for each job.

Fairness, both ways, because either side may be busy for long:

* a job waits for the readers in progress, and for every reader that was already waiting when the previous job
  ended, so a stream on a busy node still gets one turn between two steps;
* a reader that already had its turn since the last job waits while a job wants the pool, so a stream that could
  keep the socket full never holds a step back for more than one read.

``waited`` tells a reader that a job ran while it had work left: a stream then copies what it still has to send
out of the pool in one go (``PoolPages.detach``) instead of crawling one turn per step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


class LeaseTurn:
    """One reader's place in the lease: which gap between jobs it last read in, and whether it ever had to wait."""

    __slots__ = ("gap", "waited")

    def __init__(self) -> None:
        self.gap = -1
        self.waited = False


class PoolLease:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0  # reading now
        self._waiting: set[LeaseTurn] = set()  # readers waiting for a turn
        self._job = False  # the model thread runs a job
        self._job_waiting = False
        self._gap = 0  # how many jobs have ended: the gap readers are in
        self._before_job: list[Callable[[], None]] = []  # to run at the start of the next job (before_next_job)

    def turn(self) -> LeaseTurn:
        """A new reader's place (one per stream)."""
        return LeaseTurn()

    def reserve(self) -> LeaseTurn:
        """From the model thread, inside a job: a reader's turn that the next job waits for, until that reader has
        had it (``read``) or gave it up (``forgo``). So a reader started now sees the pool as this job leaves it."""
        turn = LeaseTurn()
        with self._cond:
            self._waiting.add(turn)
        return turn

    def forgo(self, turn: LeaseTurn) -> None:
        """A reserved turn that will never read."""
        with self._cond:
            self._waiting.discard(turn)
            self._cond.notify_all()

    @contextmanager
    def read(self, turn: LeaseTurn) -> Iterator[None]:
        """Hold the pool still (no job runs) for the body. Keep it short, and drop every view before leaving."""
        with self._cond:
            self._waiting.add(turn)
            try:
                while self._job or (self._job_waiting and turn.gap == self._gap):
                    turn.waited = True
                    self._cond.wait()
            finally:
                self._waiting.discard(turn)
            turn.gap = self._gap
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @property
    def jobs_ended(self) -> int:
        """How many jobs have ended: a reader of the pool that sees it move by one between two of its own jobs knows
        that no other job ran in between (the KV checksum of a streamed write relies on it: ``control/overlap.py``)."""
        return self._gap

    def before_next_job(self, work: Callable[[], None]) -> None:
        """Run ``work`` at the start of the next job, once its readers are done and before the job's body: the last
        moment at which the pool is still as the jobs so far left it (the KV checksum of a send from the pool
        finishes there: ``kv_checksum.SendSums``). An error of ``work`` is logged, not the job's."""
        with self._cond:
            self._before_job.append(work)

    def contended(self) -> bool:
        """A job is waiting for the pool (a reader should end its turn)."""
        return self._job_waiting

    @contextmanager
    def job(self) -> Iterator[None]:
        """The model thread, around each job: waits for readers in progress and those owed a turn."""
        with self._cond:
            self._job_waiting = True
            try:
                while self._readers or any(turn.gap != self._gap for turn in self._waiting):
                    self._cond.wait()
            finally:
                self._job_waiting = False
            self._job = True
            before, self._before_job = self._before_job, []
        try:
            for work in before:
                try:
                    work()
                except Exception:  # noqa: BLE001 - the job it precedes is not the one that failed
                    log.exception("work before a job failed")
            yield
        finally:
            with self._cond:
                self._job = False
                self._gap += 1
                self._cond.notify_all()
