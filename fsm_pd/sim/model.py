"""The simulated model thread: jobs run one at a time, in submission order, each ``delay`` virtual seconds after
the one before (a slow model thread is a larger delay). Futures complete on the simulator's thread, so their
callbacks run at once, in order. A job that keeps the thread busy after it returned (a layer-by-layer gather whose
layers become final over virtual time, a prefill chunk) says so with ``busy_for``.

Every job runs under the production ``PoolLease`` (``lease.job()``), as the ``ModelThread``'s do, and a send from the
pool reads under ``lease.read``: on one simulator thread neither ever waits, but the lease is the same object the
real readers use, and a read inside a job would deadlock here as it would there."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fsm_pd.kvpool.lease import PoolLease
from fsm_pd.sim.timeline import Timeline


class SimModel:
    def __init__(self, sched: Timeline, instance: Any, delay: Callable[[], float]):
        self.sched, self.instance, self.delay = sched, instance, delay
        self.pool = None
        self.lease = PoolLease()
        self._queue: deque[tuple[Callable[[Any], Any], Future]] = deque()
        self._running = False
        self._free_at = 0.0  # until when a job that returned still holds the thread
        self.due_at = 0.0  # when the job at the head of the queue runs

    def submit(self, job: Callable[[Any], Any]) -> Future:
        future: Future = Future()
        self._queue.append((job, future))
        if not self._running:
            self._next()
        return future

    def busy_for(self, seconds: float) -> None:
        """Called from a job: the thread is busy for ``seconds`` more; no job starts before then."""
        self._free_at = max(self._free_at, self.sched.clock.now() + seconds)

    def queued(self) -> int:
        return len(self._queue)

    def _next(self) -> None:
        self._running = bool(self._queue)
        if self._running:
            now = self.sched.clock.now()
            wait = max(0.0, self._free_at - now) + self.delay()
            self.due_at = now + wait
            self.sched.later(wait, self._run_head, self.instance)

    def _run_head(self) -> None:
        job, future = self._queue.popleft()
        try:
            with self.lease.job():
                result = job(self)
        except Exception as exc:  # noqa: BLE001 - delivered through the future, as a thread pool does
            future.set_exception(exc)
        else:
            future.set_result(result)
        self._next()
