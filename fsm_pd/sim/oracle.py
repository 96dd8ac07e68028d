"""A second opinion on the journals: the literal transition tables, read directly, not through ``fire``.

Replay (``fsm_pd.store.replay``) fires each journaled event through the same ``TransferMachine.fire`` that wrote it,
so it proves that a journal is self-consistent, not that its decisions were right: a wrong ``fire`` (or a wrong
guard, or a table compiled in the wrong order) replays its own mistakes. This module decides every journaled event
again from the rules as the tables (``fsm_pd.machines.sender``, ``receiver``) and ``docs/state-machines.md`` state
them, with its own reading of every guard and of the failure reasons, and compares what the journal recorded: the
state before and after, the effects asked for, why an event was ignored, the failure reason. Each room's rows must
also be versions 0, 1, 2, ... starting with its one ``create``. Deliberately plain: it shares no code with ``fire``.

The rules:

1. A room in Success or Failed ignores every event ("room is already <state>").
2. Otherwise the table's rows for (trigger, state) are tried in table order; the first whose ``conditions`` all
   hold and whose ``unless`` all do not wins. No row: the event is ignored ("no <trigger> from <state>").
3. The winning row moves the room to its ``dest``, counts the trigger as seen, disarms the timers it cancels and
   arms those it arms, and merges the event's payload into the room's context. Entering Failed gives the row's
   ``reason`` or one derived from the event (below), and disarms every timer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from fsm_pd.machines.effect_types import ArmTimer, CancelTimer
from fsm_pd.machines.receiver import RECEIVER_TRANSITIONS
from fsm_pd.machines.sender import SENDER_TRANSITIONS

TABLES = {"prefill": SENDER_TRANSITIONS, "decode": RECEIVER_TRANSITIONS}
START, ENDS = "Bootstrapping", ("Success", "Failed")


@dataclass
class OracleRoom:
    state: str = START
    version: int = 0
    seen: set[str] = field(default_factory=set)
    armed: set[str] = field(default_factory=set)
    ctx: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None


def _same_layout(ours: Any, theirs: Any) -> bool:
    """Two KV layouts agree in everything but the number of pages of the pool and how a node splits it over its
    devices (``tp``, ``shard_axis``: a handoff between different splits reshards, ``tensor-parallel.md``)."""
    if not isinstance(ours, dict) or not isinstance(theirs, dict):
        return False
    local = ("num_pages", "tp", "shard_axis")
    return {k: v for k, v in ours.items() if k not in local} == {k: v for k, v in theirs.items() if k not in local}


# Every guard the tables name, as the tables' comments and docs/state-machines.md define it.
GUARDS = {
    "is_new": lambda room, event: room.version == 0,
    "kv_ready_seen": lambda room, event: "kv_ready" in room.seen,
    "published_seen": lambda room, event: "published" in room.seen,
    "bootstrap_resolved_seen": lambda room, event: "bootstrap_resolved" in room.seen,
    "pages_reserved_seen": lambda room, event: "pages_reserved" in room.seen,
    "pulled_seen": lambda room, event: "pulled" in room.seen,
    "timer_armed": lambda room, event: event.get("timer") in room.armed,
    "layout_matches": lambda room, event: _same_layout(room.ctx.get("layout"), event.get("peer_layout")),
}


def reason_for(trigger: str, event: Mapping[str, Any]) -> str:
    """Why a room failed, from the event that failed it (architecture.md: derived, never stored by the caller)."""
    detail = event.get("reason")
    if trigger == "timeout":
        return f"{event.get('timer')} timeout"
    if trigger == "peer_abort":
        return "aborted by peer" + (f": {detail}" if detail else "")
    if trigger == "peer_failed":
        return "peer failed" + (f": {detail}" if detail else "")
    if trigger == "abort":
        return detail or "aborted"
    if trigger == "error":
        return f"{event.get('blame', 'local')} error" + (f": {detail}" if detail else "")
    return detail or trigger


def decide(table: list[Mapping], room: OracleRoom, trigger: str, event: Mapping[str, Any]) -> dict:
    """Apply one event to ``room``; returns what the journal row must say: ``dst``, ``effects``, and ``ignored``
    or ``reason``. The event counts in the room's version however it is decided (after the guards read it)."""
    out = _decide(table, room, trigger, event)
    room.version += 1
    return out


def _decide(table: list[Mapping], room: OracleRoom, trigger: str, event: Mapping[str, Any]) -> dict:
    if room.state in ENDS:
        return {"dst": room.state, "effects": [], "ignored": f"room is already {room.state}"}
    for row in table:
        if row["trigger"] != trigger or row["source"] != room.state:
            continue
        if all(GUARDS[g](room, event) for g in row.get("conditions", ())) and not any(
                GUARDS[g](room, event) for g in row.get("unless", ())):
            break
    else:
        return {"dst": room.state, "effects": [], "ignored": f"no {trigger} from {room.state}"}
    effects = row["effects"]
    room.state = row["dest"]
    room.seen.add(trigger)
    room.armed -= {e.timer for e in effects if isinstance(e, CancelTimer)}
    room.armed |= {e.timer for e in effects if isinstance(e, ArmTimer)}
    room.ctx.update(event)
    out = {"dst": room.state, "effects": [{"type": type(e).__name__, **asdict(e)} for e in effects]}
    if room.state == "Failed":
        room.reason = out["reason"] = row.get("reason") or reason_for(trigger, event)
        room.armed.clear()
    return out


def check_rows(rows: Iterable[Any]) -> tuple[list[str], dict[tuple[str, str, int], OracleRoom]]:
    """Decide every journal row again; returns the disagreements and every room as the oracle leaves it."""
    sides: dict[tuple[str, str, int], list] = defaultdict(list)
    for row in rows:
        if row.role in TABLES:  # the records no machine fires (``store/roles.py``) are replay's to check
            sides[(row.node, row.role, row.room)].append(row)
    found, rooms = [], {}
    for key, side in sorted(sides.items()):
        side.sort(key=lambda r: (r.version, r.seq))
        room = rooms[key] = OracleRoom()
        for row in side:
            where = f"{key[1]} room {key[2]} v{row.version} {row.trigger}"
            if row.version != room.version:
                found.append(f"{where}: expected version {room.version}")
                break
            if (row.version == 0) != (row.trigger == "create"):
                found.append(f"{where}: a room's first row, and only it, is its create")
                break
            src = room.state
            want = decide(TABLES[key[1]], room, row.trigger, row.event)
            got = {"dst": row.dst, "effects": row.payload.get("effects")}
            for extra in ("ignored", "reason"):
                if extra in row.payload or extra in want:
                    got[extra] = row.payload.get(extra)
            if row.src != src or got != want:
                found.append(f"{where}: the tables say {src} -> {want}, the journal has {row.src} -> {got}")
                break
    return found, rooms
