"""What the bootstrap server remembers: the prefill server's layout, its ranks, and which DP rank took which room.

Rules (SGLang's ``CommonKVBootstrapServer`` unless marked *fsm-pd*):

* The first registration fixes the layout (TP/CP/DP/PP sizes, page size, KV dtype, DP dispatch). *fsm-pd:* a later
  registration that disagrees on a size, the page size or the dtype is refused (``RegistrationConflict``) instead
  of being filed under a layout it does not belong to; only a restart of the server changes the layout.
* The server is *ready* once every rank of that layout is in the table. *fsm-pd:* ranks are counted once each, so
  a rank that registers twice (a restart) cannot stand in for one that never came; SGLang counts registrations.
  A re-registration replaces the rank's entry: a restarted prefill node's new side-channel address and instance
  are what lookups return from then on.
* ``room → dp rank`` entries live ``entry_ttl_s`` seconds. SGLang sweeps every TTL, so an entry there lives between
  one and two TTLs; here it is gone exactly when the TTL passes, and at most ``max_room_entries`` are kept (the
  oldest go first), so a flood of registrations cannot grow the table without bound.

Every method takes the lock: the HTTP handlers run on one event loop, but a prefill node may hold the registry
in-process and call it from its own threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from fsm_pd.bootstrap.wire import SERVER_INFO_KEYS, RankRegistration

log = logging.getLogger(__name__)

# Fields every rank of one prefill server must agree on; a mismatch means two servers share one bootstrap server.
_LAYOUT_FIELDS = ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype")


class RegistrationConflict(ValueError):
    """A rank's registration disagrees with the layout fixed by the first one, or with ``expected_ranks``."""


class PrefillRegistry:
    def __init__(self, *, expected_ranks: int | None = None, entry_ttl_s: float = 120.0,
                 max_room_entries: int = 1 << 20, clock: Callable[[], float] = time.monotonic):
        if expected_ranks is not None and expected_ranks < 1:
            raise ValueError(f"expected_ranks must be at least 1, got {expected_ranks}")
        if entry_ttl_s <= 0:
            raise ValueError(f"entry_ttl_s must be positive, got {entry_ttl_s}")
        if max_room_entries < 1:
            raise ValueError(f"max_room_entries must be at least 1, got {max_room_entries}")
        self.expected_ranks = expected_ranks
        self.entry_ttl_s = entry_ttl_s
        self.max_room_entries = max_room_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._first: RankRegistration | None = None  # the registration that fixed the layout
        self._ranks: dict[tuple[int, int, int, int], RankRegistration] = {}
        # Insertion order is expiry order: a re-registered room moves to the end, so expiry pops from the front.
        self._rooms: OrderedDict[int, tuple[int, float]] = OrderedDict()

    # ---- prefill ranks ------------------------------------------------------------------------------------------

    def register(self, reg: RankRegistration) -> int:
        """File a rank; return how many distinct ranks are registered now."""
        with self._lock:
            if self._first is None:
                if self.expected_ranks is not None and reg.expected_ranks != self.expected_ranks:
                    raise RegistrationConflict(
                        f"this server expects {self.expected_ranks} prefill ranks, but the registration describes "
                        f"{reg.expected_ranks} (dp {reg.dp_size} x cp {reg.attn_cp_size} x tp {reg.attn_tp_size} "
                        f"x pp {reg.pp_size})")
                self._first = reg
            else:
                differing = [f"{name}={getattr(reg, name)!r} (registered: {getattr(self._first, name)!r})"
                             for name in _LAYOUT_FIELDS if getattr(reg, name) != getattr(self._first, name)]
                if differing:
                    raise RegistrationConflict(
                        "the registration disagrees with the prefill layout already registered: "
                        + ", ".join(differing) + "; restart the bootstrap server to change the layout")
            old = self._ranks.get(reg.key)
            self._ranks[reg.key] = reg
            if old is not None and old.instance != reg.instance:
                log.info("prefill rank dp=%d cp=%d tp=%d pp=%d re-registered: instance %s replaces %s", *reg.key,
                         reg.instance, old.instance)
            return len(self._ranks)

    def deregister(self, reg: RankRegistration) -> str:
        """*fsm-pd:* take a rank out (a prefill node draining before it stops), so lookups stop returning it.
        Only the instance that registered it may: a late deregistration from a process that was already replaced
        must not remove its successor. Returns ``"removed"``, ``"absent"`` (no such rank) or ``"replaced"`` (another
        instance holds the rank; left in place). The layout stays fixed; the server is not ready again until the
        rank registers again (decode lookups get 503 meanwhile, and retry)."""
        with self._lock:
            old = self._ranks.get(reg.key)
            if old is None:
                return "absent"
            if reg.instance is not None and old.instance is not None and old.instance != reg.instance:
                return "replaced"
            del self._ranks[reg.key]
            log.info("prefill rank dp=%d cp=%d tp=%d pp=%d (instance %s) deregistered", *reg.key, old.instance)
            return "removed"

    @property
    def registered_count(self) -> int:
        with self._lock:
            return len(self._ranks)

    @property
    def expected_count(self) -> int | None:
        """How many ranks make the server ready; None while neither ``expected_ranks`` nor a registration says."""
        with self._lock:
            return self._expected_locked()

    def _expected_locked(self) -> int | None:
        return self.expected_ranks if self._first is None else self._first.expected_ranks

    def is_ready(self) -> bool:
        with self._lock:
            return self._first is not None and len(self._ranks) >= self._first.expected_ranks

    def server_info(self) -> dict[str, Any] | None:
        """The layout answer (SGLang's ``PrefillServerInfo``, exactly its keys), or None while not ready."""
        with self._lock:
            first = self._first
            if first is None or len(self._ranks) < first.expected_ranks:
                return None
            info = dict.fromkeys(SERVER_INFO_KEYS)  # the decode-side mapping fields stay null, as SGLang sends them
            info.update(
                attn_tp_size=first.attn_tp_size, attn_cp_size=first.attn_cp_size, dp_size=first.dp_size,
                pp_size=first.pp_size, page_size=first.page_size, kv_cache_dtype=first.kv_cache_dtype,
                follow_bootstrap_room=first.load_balance_method == "follow_bootstrap_room",
                enable_dsa_cache_layer_split=first.enable_dsa_cache_layer_split,
                # SGLang keeps the first port any rank sent, not necessarily the first rank's.
                prefill_http_port=next((r.prefill_http_port for r in self._ranks.values()
                                        if r.prefill_http_port is not None), None),
            )
            return info

    def lookup(self, dp_rank: int, cp_rank: int, tp_rank: int, pp_rank: int) -> dict[str, Any] | None:
        """One rank's answer (``rank_ip``, ``rank_port`` and its extras), or None if no such rank registered."""
        with self._lock:
            reg = self._ranks.get((dp_rank, cp_rank, tp_rank, pp_rank))
            return None if reg is None else reg.rank_info()

    def ranks(self) -> list[RankRegistration]:
        with self._lock:
            return list(self._ranks.values())

    # ---- room → dp rank -----------------------------------------------------------------------------------------

    def register_room(self, room: int, dp_rank: int) -> None:
        with self._lock:
            now = self._clock()
            self._expire_locked(now)
            self._rooms.pop(room, None)
            self._rooms[room] = (dp_rank, now)
            while len(self._rooms) > self.max_room_entries:
                self._rooms.popitem(last=False)

    def query_rooms(self, rooms: Iterable[int]) -> dict[str, int]:
        """``{str(room): dp_rank}`` for the rooms known and not expired; others are left out, as in SGLang."""
        with self._lock:
            self._expire_locked(self._clock())
            found = {}
            for room in rooms:
                entry = self._rooms.get(room)
                if entry is not None:
                    found[str(room)] = entry[0]
            return found

    @property
    def room_count(self) -> int:
        with self._lock:
            self._expire_locked(self._clock())
            return len(self._rooms)

    def _expire_locked(self, now: float) -> None:
        while self._rooms:
            _, (_, stamped) = next(iter(self._rooms.items()))
            if now - stamped < self.entry_ttl_s:
                break
            self._rooms.popitem(last=False)
