"""The decode node's health check of the prefill nodes it pulls from (SGLang's heartbeat).

Superseded by ``PeerMonitor`` (``peer_monitor.py``), which probes the peer node itself over the side channel and
sees restarts by instance id; this probe of the bootstrap server's ``/health`` misses a dead prefill node behind a
standalone bootstrap server. It stays until the KV manager is wired to ``PeerMonitor``, and then goes.

Every ``interval`` seconds each watched URL is checked; after ``max_failures`` misses in a row it is declared dead
once, ``on_dead(url)`` fails its rooms and drops what was cached about it, and it stops being watched: the next
request for that prefill node resolves it afresh (a restarted node at the same address is then used as new, the
lesson of SGLang issue 16903).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0  # SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL
DEFAULT_MAX_FAILURES = 2  # SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE


class HeartbeatMonitor:
    def __init__(self, check: Callable[[str], bool], on_dead: Callable[[str], None], *,
                 interval_s: float = DEFAULT_INTERVAL_S, max_failures: int = DEFAULT_MAX_FAILURES):
        if interval_s <= 0 or max_failures < 1:
            raise ValueError("heartbeat interval must be positive and max_failures at least 1")
        self.check, self.on_dead = check, on_dead
        self.interval_s, self.max_failures = interval_s, max_failures
        self._misses: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def watch(self, url: str) -> None:
        with self._lock:
            self._misses.setdefault(url, 0)

    def watched(self) -> list[str]:
        with self._lock:
            return sorted(self._misses)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for url in self.watched():
                alive = self._safe_check(url)
                with self._lock:
                    if url not in self._misses:
                        continue
                    self._misses[url] = 0 if alive else self._misses[url] + 1
                    dead = self._misses[url] >= self.max_failures
                    if dead:
                        del self._misses[url]
                if dead:
                    log.warning("prefill node at %s missed %d heartbeats: failing its rooms", url, self.max_failures)
                    self.on_dead(url)

    def _safe_check(self, url: str) -> bool:
        try:
            return bool(self.check(url))
        except Exception:  # noqa: BLE001 - any failure to answer is a miss
            return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
