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

from fsm_pd.effects.ports import OnProgress, ResultDone

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
    """``backend.pull`` on ``workers``; ``spec_for(page_count, piece)`` is what a verified staging array (or piece of
    a resharding plan) must look like."""

    def __init__(self, backend: Any, spec_for: Callable[[int, Any], tuple], workers: Executor):
        self.backend, self.spec_for, self.workers = backend, spec_for, workers

    def pull(self, address: str, uuid: int, page_count: int, timeout_s: float, *, done: ResultDone,
             on_progress: OnProgress | None = None, delay_s: float = 0.0, piece: Any = None) -> None:
        def work() -> Any:
            if delay_s:
                time.sleep(delay_s)
            (staging,) = self.backend.pull(address, uuid, self.spec_for(page_count, piece), timeout_s,
                                           on_progress=on_progress)
            return staging

        self.workers.submit(_call, done, work)


class LocalPuller(ThreadedPuller):
    """A ``pool`` backend's pulls (two engines of one process): one whose entry is already settled, published or
    ended, cannot block, so it is taken at once on the caller's thread (``pull_settled``); any other still waits on
    a worker."""

    def pull(self, address: str, uuid: int, page_count: int, timeout_s: float, *, done: ResultDone,
             on_progress: OnProgress | None = None, delay_s: float = 0.0, piece: Any = None) -> None:
        if not delay_s:
            try:
                settled = self.backend.pull_settled(address, uuid)
            except Exception as exc:  # noqa: BLE001 - the pull's own error, reported as a worker's would be
                _report(done, None, exc)
                return
            if settled is not None:
                _report(done, settled[0], None)
                return
        super().pull(address, uuid, page_count, timeout_s, done=done, on_progress=on_progress, piece=piece,
                     delay_s=delay_s)


class ThreadedResolver:
    """The real ``ResolverPort``: a ``PrefillResolver``'s ``resolve`` with its lookups made on ``workers``. A room is
    answered at once from the cache, joins the lookup of its rank under way, or leads one; only that one lookup per
    rank holds a worker, so a bootstrap server that is down (retried for seconds) cannot hold every worker while rooms
    of live nodes wait. The simulation runs this class with simulated workers."""

    def __init__(self, resolver: Callable[[], Any], workers: Executor):
        """``resolver()``: the node's resolver now (a test may swap it for a plain function of ``ctx``)."""
        self.resolver, self.workers = resolver, workers

    def resolve(self, ctx: Mapping[str, Any], done: ResultDone) -> None:
        ctx, lookup = dict(ctx), self.resolver()
        resolve = getattr(lookup, "resolve", None)
        if resolve is None:  # a plain function: it blocks, so it runs on a worker
            self.workers.submit(_call, done, lambda: lookup(ctx))
            return
        resolve(ctx, lambda result, error: _report(done, result, error), self.run)

    def run(self, call: Callable[[], Any], done: ResultDone) -> None:
        """The resolver's lookup port: one blocking lookup on a worker."""
        self.workers.submit(_call, done, call)
