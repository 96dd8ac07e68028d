"""Rate limiting for log lines that a peer can trigger at will (dropped frames): one report per key per interval."""

from __future__ import annotations


class RateLimiter:
    """At most one report per key per ``interval_s``; tells the caller how many were suppressed in between."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def allow(self, key: str, now: float) -> int | None:
        """``None`` to stay quiet, else the number of reports suppressed since the last one."""
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._suppressed.pop(key, 0)
