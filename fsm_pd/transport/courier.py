"""Heartbeat frames that could not leave at once, retried off the caller's thread until they go or expire.

A side channel answers a ping from its listener thread and sends its own pings from a timer; neither may wait for a
peer. So a heartbeat is first offered with a non-blocking send. That fails only when no live connection to the peer
exists yet (the first frame to a new address, or a peer that is reconnecting or gone) or another thread is sending to
it; the frame is then handed to the courier.

The courier keeps at most one frame per (address, kind): a newer ping or pong to the same peer replaces an older one,
which is stale anyway. Its one thread offers every pending frame once per pass, without ever blocking on one, so a
dead peer cannot hold up the heartbeats of a live one. A frame that has not left within ``timeout_s`` is dropped and
counted: a peer that cannot take a heartbeat for that long will be missing heartbeats anyway. ``on_expired(addr)``
is then told, so that the side channel drops its socket to that address instead of reconnecting to a dead peer
forever (a restarted peer usually comes back on another port).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)

RETRY_S = 0.01  # between passes while frames are pending; a connection to a live peer is up within a few passes
MAX_PENDING = 4096  # one slot per (peer, kind): a node watching more peers than this is misconfigured


class Courier:
    """``offer(addr, frame) -> bool`` is a non-blocking send that may raise; the courier retries it."""

    def __init__(self, offer: Callable[[str, bytes], bool], *, timeout_s: float, name: str,
                 on_expired: Callable[[str], None] = lambda addr: None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._offer, self._timeout_s, self._on_expired = offer, timeout_s, on_expired
        self._pending: dict[tuple[str, Hashable], tuple[bytes, float]] = {}
        self._cv = threading.Condition()
        self._stopped = False
        self.expired = 0  # frames dropped unsent (timed out, refused, or no room for them)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, addr: str, kind: Hashable, frame: bytes) -> None:
        """Queue ``frame`` for ``addr``, replacing any frame of the same ``kind`` still waiting for it."""
        with self._cv:
            if self._stopped:
                return
            key = (addr, kind)
            if key not in self._pending and len(self._pending) >= MAX_PENDING:
                self.expired += 1
                return
            self._pending[key] = (frame, time.monotonic() + self._timeout_s)
            self._cv.notify()

    def pending(self) -> int:
        with self._cv:
            return len(self._pending)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                batch = list(self._pending.items())
            for key, entry in batch:
                done = self._try(key[0], entry[0])
                if not done and time.monotonic() < entry[1]:
                    continue
                with self._cv:
                    current = self._pending.get(key) is entry  # not replaced by a newer frame meanwhile
                    if current:
                        del self._pending[key]
                        self.expired += not done
                if current and not done:
                    self._safely_expire(key[0])
            with self._cv:
                if self._pending and not self._stopped:
                    self._cv.wait(RETRY_S)

    def _try(self, addr: str, frame: bytes) -> bool:
        """True when the frame is done with: sent, or refused for good (counted)."""
        try:
            if self._offer(addr, frame):
                return True
        except Exception as exc:  # noqa: BLE001 - a bad address or a closed channel: this frame can never go
            log.debug("heartbeat to %s cannot be sent: %s", addr, exc)
            with self._cv:
                self.expired += 1
            return True
        return False

    def _safely_expire(self, addr: str) -> None:
        try:
            self._on_expired(addr)
        except Exception:
            log.exception("courier: on_expired(%s) raised", addr)

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self.expired += len(self._pending)
            self._pending.clear()
            self._cv.notify()
        self._thread.join()
