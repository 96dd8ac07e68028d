"""Receiver-side memory that turns an authenticated message into one delivery: freshness, replay and duplicates.

Three checks, in this order, after the MAC has passed:

- **stale**: ``sent_at`` is more than ``max_skew_s`` away from the receiver's clock (either direction).
- **replayed**: the nonce was seen before. Nonces are kept only while their message could still pass the staleness
  check, i.e. while ``sent_at >= now - max_skew_s``; older ones are rejected as stale anyway. Memory is bounded by
  ``max_nonces``: when full, the nonce with the oldest ``sent_at`` is forgotten and its ``sent_at`` becomes a floor
  below which every message counts as replayed. So a forgotten nonce can never be replayed; under a flood the
  accepted window just narrows.
- **duplicate**: a message with the same ``(sender, instance, room, type)`` was already delivered (a retransmission
  with a fresh nonce, say). The instance is part of the key because a restarted peer is a new sender: what it says
  about a room is news, not a copy of what its predecessor said. HEARTBEAT is exempt: it repeats by design. A
  delivered key is remembered for ``max_skew_s`` (the nonces' window) and at most ``max_delivered`` of them, the
  oldest forgotten first: copies come within moments, while keeping every key for as long as room was left grew
  memory with every message (issue 11's soak). A duplicate that arrives after its key was forgotten is delivered
  again, which the control plane tolerates (late and duplicate messages for a room are journaled and ignored).

Not thread-safe: the side channel's listener thread is its only user.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Final

from fsm_pd.transport.messages import Message, MessageType

DEFAULT_MAX_SKEW_S: Final = 60.0
DEFAULT_MAX_NONCES: Final = 1 << 16
DEFAULT_MAX_DELIVERED: Final = 1 << 16

_NOT_DEDUPLICATED: Final = frozenset({MessageType.HEARTBEAT})


class ReplayGuard:
    def __init__(
        self,
        *,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        max_nonces: int = DEFAULT_MAX_NONCES,
        max_delivered: int = DEFAULT_MAX_DELIVERED,
    ) -> None:
        if max_skew_s <= 0 or max_nonces < 1 or max_delivered < 1:
            raise ValueError("max_skew_s, max_nonces and max_delivered must be positive")
        self._max_skew_s = max_skew_s
        self._max_nonces = max_nonces
        self._max_delivered = max_delivered
        self._nonces: set[int] = set()
        self._by_age: list[tuple[float, int]] = []  # min-heap of (sent_at, nonce), mirrors _nonces
        self._floor = float("-inf")  # sent_at of the newest nonce forgotten for lack of room
        # key -> when it was delivered, oldest first (receiver clock; a duplicate does not refresh it)
        self._delivered: OrderedDict[tuple[str, str, int, MessageType], float] = OrderedDict()

    def check(self, msg: Message, now: float) -> str | None:
        """Record ``msg`` and return ``None`` if it should be delivered, else the reason to drop it."""
        if abs(now - msg.sent_at) > self._max_skew_s:
            return "stale"
        self._expire(now)
        if msg.nonce in self._nonces or msg.sent_at <= self._floor:
            return "replayed"
        self._remember_nonce(msg)
        if msg.TYPE in _NOT_DEDUPLICATED:
            return None
        key = (msg.sender, msg.instance, msg.room, msg.TYPE)
        if key in self._delivered:
            return "duplicate"
        self._delivered[key] = now
        if len(self._delivered) > self._max_delivered:
            self._delivered.popitem(last=False)
        return None

    @property
    def remembered_deliveries(self) -> int:
        return len(self._delivered)

    @property
    def remembered_nonces(self) -> int:
        return len(self._nonces)

    def _expire(self, now: float) -> None:
        horizon = now - self._max_skew_s
        while self._by_age and self._by_age[0][0] < horizon:
            _, nonce = heapq.heappop(self._by_age)
            self._nonces.discard(nonce)
        delivered = self._delivered
        while delivered and next(iter(delivered.values())) < horizon:
            delivered.popitem(last=False)

    def _remember_nonce(self, msg: Message) -> None:
        self._nonces.add(msg.nonce)
        heapq.heappush(self._by_age, (msg.sent_at, msg.nonce))
        if len(self._nonces) > self._max_nonces:
            sent_at, nonce = heapq.heappop(self._by_age)
            self._nonces.discard(nonce)
            self._floor = max(self._floor, sent_at)
