"""The model thread: the one thread that reads and writes the KV pool.

Everything that touches the pool (a forward pass, a gather for a transfer, a scatter of pulled KV, freeing pages
that a queued scatter may still write) is a job on this thread, so jobs are ordered: a FreePages queued after a
Scatter runs after it, and pages can never be handed to another request while a write to them is pending.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ModelThread:
    """Owns ``pool`` (a tuple of per-layer arrays); ``submit(job)`` runs ``job(self)`` on the model thread."""

    def __init__(self, pool: Any = None, name: str = "model"):
        self.pool = pool
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, job: Callable[[ModelThread], T]) -> Future[T]:
        return self._executor.submit(job, self)

    def call(self, job: Callable[[ModelThread], T], timeout: float | None = None) -> T:
        """Run ``job`` on the model thread and wait for its result."""
        return self.submit(job).result(timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
