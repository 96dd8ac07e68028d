"""Guards: pure predicates over a room's recorded state and the event's payload.

A guard may read ``room`` (its state, the triggers it has accepted, its armed timers, its recorded context) and
``payload``; nothing else. No clocks, no randomness, no globals: that is what makes a journal replayable.
"""

from __future__ import annotations

from typing import Any


def is_new(room: Any, payload: dict) -> bool:
    return room.version == 0


def kv_ready_seen(room: Any, payload: dict) -> bool:
    return "kv_ready" in room.seen


def published_seen(room: Any, payload: dict) -> bool:
    return "published" in room.seen


def bootstrap_resolved_seen(room: Any, payload: dict) -> bool:
    return "bootstrap_resolved" in room.seen


def pages_reserved_seen(room: Any, payload: dict) -> bool:
    return "pages_reserved" in room.seen


def pulled_seen(room: Any, payload: dict) -> bool:
    return "pulled" in room.seen


def timer_armed(room: Any, payload: dict) -> bool:
    """A timeout counts only for a timer that is still armed: a cancelled timer that fires late is ignored."""
    return payload.get("timer") in room.armed


# Layout fields each node chooses for itself: the pool's size, and how it is split over devices (a handoff between
# different tensor-parallel sizes reshards the KV, ``transport/reshard.py``).
_NODE_LOCAL = ("num_pages", "shard_axis", "tp")


def layout_matches(room: Any, payload: dict) -> bool:
    """The peer's KV layout agrees with ours in everything but the page count and the device split.

    The transfer libraries check only byte sizes; two pools with swapped head_dim and page_size would transfer
    "successfully" and corrupt the cache, so the layouts are compared before anything moves.
    """
    ours, theirs = room.ctx.get("layout"), payload.get("peer_layout")
    if not isinstance(ours, dict) or not isinstance(theirs, dict):
        return False
    return not layout_differences(ours, theirs)


def layout_differences(ours: dict, theirs: dict) -> dict:
    """``{field: {"ours": ..., "peer": ...}}`` for every shared layout field the two disagree on (a page size of 16
    against 64, say: the CPU's default against a TPU's); empty when ``layout_matches`` would hold."""
    fields = sorted((set(ours) | set(theirs)) - set(_NODE_LOCAL))
    return {k: {"ours": ours.get(k), "peer": theirs.get(k)} for k in fields if ours.get(k) != theirs.get(k)}


GUARDS = {
    f.__name__: f
    for f in (
        is_new,
        kv_ready_seen,
        published_seen,
        bootstrap_resolved_seen,
        pages_reserved_seen,
        pulled_seen,
        timer_armed,
        layout_matches,
    )
}
