"""Oracles over both sides of a room: P's and D's outcomes agree, or a recorded fault explains why not; and no
corrupted handoff reaches decode.

Which disagreements the tables allow (``machines/sender.py``, ``receiver.py``):

- **P Success, D anything but Success: never.** P reaches Success only on ``pull_done``, i.e. a PULLED, and D sends
  PULLED only as an effect of ``scattered`` -> Success (journaled before the send). No fault makes this legitimate.
- **D Success, P Failed: only when PULLED did not reach P in time, or P failed on its own first.** D is done once it
  has scattered and verified the bytes; P still waits for PULLED (``pull_hold``). The reasons P can then fail with,
  each with the faults that can cause it:

  | P's reason | explained by a recorded |
  | --- | --- |
  | ``pull_hold timeout`` | PULLED of the room dropped, delayed, lost, cut by a partition or unreachable; a stall of
    either node; a crash of D (between journaling Success and sending PULLED) |
  | ``node restarted`` | crash of P |
  | ``peer failed: decode node ...`` (missed heartbeats, restarted) | crash or stall of D, or a partition |
  | ``client went away`` (or any local abort) | client abort of the room on P |

  D Success with P failed by anything else (``aborted by peer``: D never sends ABORT for a room it completed; a
  layout mismatch; a gather that failed after D had every byte) is a violation.
- **Both Failed**: they agree (each side's own reason; replay explains each).

Faults are recorded as they are injected (``World.record``: the network's fates per message, crashes, stalls,
client aborts, partitions, corrupted pulls), so the explanation is checked against what happened to this room.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm_pd.store import replay

if TYPE_CHECKING:
    from fsm_pd.sim.world import World

# P's failure reason (a prefix) -> the kinds of recorded fault (prefixes) that explain it when D succeeded
EXPLAINED_BY = {
    "pull_hold timeout": ("message drop", "message delay", "message lost", "message partitioned",
                          "message unreachable", "stall", "crash", "partition"),
    "node restarted": ("crash",),
    "peer failed": ("crash", "stall", "partition"),
    "client went away": ("client abort",),
}
PULLED_FAULTS = ("message",)  # a message fault must be PULLED's own to explain a pull_hold timeout


def outcome_disagreements(world: World) -> list[str]:
    """Rooms whose two sides ended in outcomes the tables do not allow, or allow only under a fault that was not
    recorded (see the module docstring)."""
    prefill, decode = world.prefill.live_rooms(), world.decode.live_rooms()
    found = []
    for room_id in sorted(set(prefill) & set(decode)):
        p, d = prefill[room_id], decode[room_id]
        if not (p.terminal and d.terminal):
            continue
        if p.state == "Success" and d.state != "Success":
            found.append(f"room {room_id}: prefill Success but decode {d.state} ({d.reason}): P saw a PULLED that D "
                         "never sends without succeeding")
        elif d.state == "Success" and p.state != "Success":
            why = explanation(world, room_id, p.reason or "")
            if why is None:
                found.append(f"room {room_id}: decode Success but prefill Failed ({p.reason}), and no recorded fault "
                             f"explains it (faults of the room: {[f.kind for f in world.faults_of(room_id)][:6]})")
    return found


def explanation(world: World, room: int, reason: str) -> str | None:
    """The recorded fault that explains P failing with ``reason`` while D succeeded, or None."""
    for prefix, kinds in EXPLAINED_BY.items():
        if prefix not in reason:  # after the trigger's own words ("local error: node restarted")
            continue
        for fault in world.fault_log:
            if not fault.kind.startswith(kinds):
                continue
            if fault.kind.startswith(PULLED_FAULTS) and not (fault.room == room and "PULLED" in fault.detail):
                continue
            if fault.kind == "client abort" and fault.room != room:
                continue
            if fault.kind == "partition" or fault.room in (None, room):
                return f"{fault.kind} at t={fault.at:.3f}: {fault.detail}"
    return None


def corrupted_rooms(world: World) -> set[int]:
    return {f.room for f in world.fault_log if f.kind == "corrupt" and f.room is not None}


def corruption_served(world: World, rows: list | None = None) -> list[str]:
    """Every handoff whose bytes a fault corrupted (``corrupt``) must not reach decode: its decode side ends Failed,
    and where it failed on the check, replay names the checksum. Called once the rooms have ended."""
    found = []
    decode = world.decode.live_rooms()
    reports = None
    for room_id in sorted(corrupted_rooms(world)):
        d = decode.get(room_id)
        if d is None or not d.terminal:
            continue
        if d.state == "Success":
            found.append(f"room {room_id}: its pulled KV was corrupted, and the decode side reached Success "
                         "(a corrupted prompt would have been decoded)")
            continue
        if "checksum mismatch" not in (d.reason or "") or rows is None:
            continue  # it failed for another reason before its check (a timeout, an abort): nothing was decoded
        if reports is None:
            reports = {(r.role, r.room): r for r in replay(rows).rooms}
        report = reports.get(("decode", room_id))
        if report is None or "checksum" not in (report.why or ""):
            found.append(f"room {room_id}: failed on the KV checksum, but replay explains it as "
                         f"{None if report is None else report.why!r}")
    return found
