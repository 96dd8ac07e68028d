"""A router request's retries: the settings (``--retry-policy``, ``--max-retries``, the budget's flags), one
request's tries (``Tries``: retries and migrations together), the wait before each (``retry_backoff``), and the
router-wide budget over a sliding window (``RetryBudget``), so a lone failure is always retried and a dead fleet is not
hammered. ``core.py`` decides when a failed attempt is tried again; this module only counts. No I/O: the budget takes
a ``clock`` (seconds, monotonic), so it is unit-tested with a fake one.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]

RETRY_POLICIES = ("retry", "fail")
RETRY_BACKOFF_S, RETRY_BACKOFF_MAX_S = 0.05, 1.0  # before the n-th retry: 50 ms x 2^(n-1), at most 1 s


@dataclass(frozen=True, slots=True)
class RetrySettings:
    policy: str = "retry"  # "fail": every failure goes to the client as it came (today's sglang-router-like PD)
    max_retries: int = 2  # per request: retries before the first token, and migrations of a stream, together
    budget_ratio: float = 0.2  # router-wide: retries <= this x requests over the window ...
    budget_min_per_s: float = 10.0  # ... but never fewer than this many per second (Linkerd's default)
    budget_window_s: float = 10.0
    # a stream whose decode breaks off continues on another pair (``migrate.py``); that costs a JSON decode and
    # encode of every event on the router's loop, for nothing where no other decode worker exists (``--role pd``)
    migrate: bool = True


DEFAULT_RETRY = RetrySettings()


def retry_backoff(retry: int) -> float:
    """Seconds to wait before a request's ``retry``-th retry, longer after each (sglang-router's schedule: 50 ms,
    doubling): a worker that just failed gets a moment for its health check to tell whether it is gone, and a
    failing fleet is not hammered (a dead prefill was tried 3 times within 30 ms)."""
    return min(RETRY_BACKOFF_S * 2 ** (retry - 1), RETRY_BACKOFF_MAX_S) if retry > 0 else 0.0


@dataclass
class Tries:
    """One request's retries and migrations, together."""

    max_retries: int
    used: int = 0
    free: int = 0  # retries after a refused connection: they use no try (each took a worker out)
    first: str = ""  # what went wrong first (a drain that aborted the stream), when later attempts fail otherwise
    last: str = ""

    @property
    def left(self) -> int:
        return self.max_retries - self.used


class RetryBudget:
    """Retries allowed over the last ``window_s``: at most ``ratio`` x the requests that arrived in it, and never
    fewer than ``min_per_s`` x ``window_s``."""

    def __init__(self, ratio: float = 0.2, min_per_s: float = 10.0, window_s: float = 10.0,
                 clock: Clock = time.monotonic):
        if ratio < 0 or min_per_s < 0 or window_s <= 0:
            raise ValueError("the retry budget's ratio and floor must not be negative, its window positive")
        self.ratio, self.min_per_s, self.window_s, self.clock = ratio, min_per_s, window_s, clock
        self._requests: collections.deque[float] = collections.deque()
        self._retries: collections.deque[float] = collections.deque()

    def _trim(self, now: float) -> None:
        for times in (self._requests, self._retries):
            while times and times[0] <= now - self.window_s:
                times.popleft()

    def request(self) -> None:
        """A client request arrived."""
        now = self.clock()
        self._trim(now)
        self._requests.append(now)

    def allowed(self) -> float:
        return max(self.min_per_s * self.window_s, self.ratio * len(self._requests))

    def try_retry(self) -> bool:
        """Spend one retry if the budget has one left."""
        now = self.clock()
        self._trim(now)
        if len(self._retries) + 1 > self.allowed():
            return False
        self._retries.append(now)
        return True

    def describe(self) -> str:
        return (f"{len(self._retries)} retries in the last {self.window_s:g} s, allowed {self.allowed():g} "
                f"(max({self.ratio:g} x {len(self._requests)} requests, {self.min_per_s:g}/s))")
