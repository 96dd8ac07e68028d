"""The real ``PullPort`` and ``ResolverPort``: blocking calls run on a small worker pool, results come back by callback.

A pull blocks up to the transfer deadline and a bootstrap lookup up to its retries, so neither may run on the node
loop. Both report through ``done(result, error)`` from the worker thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any

from fsm_pd.control.ports import OnProgress, ResultDone

log = logging.getLogger(__name__)


def _call(done: ResultDone, fn: Callable[[], Any]) -> None:
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - the handler decides what the failure means
        _report(done, None, exc)
    else:
        _report(done, result, None)


def _report(done: ResultDone, result: Any, error: BaseException | None) -> None:
    try:
        done(result, error)
    except Exception:  # a bug in a callback must not kill the worker
        log.exception("worker callback failed")


class ThreadedPuller:
    """``backend.pull`` on ``workers``; ``spec_for(page_count)`` is what a verified staging array must look like."""

    def __init__(self, backend: Any, spec_for: Callable[[int], tuple], workers: Executor):
        self.backend, self.spec_for, self.workers = backend, spec_for, workers

    def pull(self, address: str, uuid: int, page_count: int, timeout_s: float, *, done: ResultDone,
             on_progress: OnProgress | None = None, delay_s: float = 0.0) -> None:
        def work() -> Any:
            if delay_s:
                time.sleep(delay_s)
            (staging,) = self.backend.pull(address, uuid, self.spec_for(page_count), timeout_s,
                                           on_progress=on_progress)
            return staging

        self.workers.submit(_call, done, work)


class ThreadedResolver:
    """``lookup(ctx)`` (a ``PrefillResolver``: HTTP with retries) on ``workers``."""

    def __init__(self, lookup: Callable[[Mapping[str, Any]], dict], workers: Executor):
        self.lookup, self.workers = lookup, workers

    def resolve(self, ctx: Mapping[str, Any], done: ResultDone) -> None:
        ctx = dict(ctx)
        self.workers.submit(_call, done, lambda: self.lookup(ctx))
