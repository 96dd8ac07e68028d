"""Why the simulation's requests failed: their failure reasons grouped, and the injected fault behind each failure.

A reason names the piece, the checksum values, the transfer and the process instance it hit (``pull failed: chunk
piece 8 (4 pages): connection reset during the pull``), so counted as they are, every failure is its own key.
``reason_group`` takes those numbers out (``chunk piece N (N pages)``), leaving what happened and where: the
addresses of a simulated world's two nodes stay.

``failed_by_fault`` names, for every request whose decode side did not succeed (what the client saw), the recorded
fault (``World.record``) that explains it, looked for in this order:

1. a fault of the request's own that fails it outright: a client's abort, a corrupted pull, a reset pull;
2. a fault of a whole node or the network (a crash, a stall, a partition, a failed bootstrap lookup) that held
   while the request was under way: from the fault until it ended (a crash's restart, the stall's or partition's
   end) plus the time a peer takes to notice (``invariants.recovery_s``);
3. any other fault of the request's own, the likeliest to fail it first (``LIKELIEST``): a message of its dropped,
   lost or sent to a dead node, then one delayed, a pull reported late, a message reordered or duplicated.

A crash explains every request it caught, however the request then failed (a message to the dead node, a deadline
on the living one), so a run whose crash fails 190 of 200 requests says so in one line. A failure no recorded fault
explains is counted under ``WITHOUT_FAULT``: a bug, which the tests keep at 0.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING

from fsm_pd.sim.invariants import recovery_s

if TYPE_CHECKING:
    from fsm_pd.sim.world import Fault, World

WITHOUT_FAULT = "no injected fault"
OUTRIGHT = ("client abort", "corrupt", "pull reset")  # a fault of one request that fails it by itself
NODE_WIDE = ("crash", "stall", "partition", "lookup failure")
# a request's other faults, the likeliest to fail it first: a message that never came, then one that came late
LIKELIEST = ("message drop", "message lost", "message unreachable", "message partitioned", "message delay",
             "late pull report", "message reorder", "message duplicate")

_HEX = re.compile(r"\b0x[0-9a-f]+\b")
_INSTANCE = re.compile(r"\b[0-9a-f]{16}\b")  # a process instance id (``new_instance_id``)
# a number standing alone, not a part of an address (10.0.0.1:7000) or of a name (decode-0, prefill-0#2)
_NUMBER = re.compile(r"(?<![\w.:/#-])\d+(?:\.\d+)?(?![\w.])")


def reason_group(reason: str) -> str:
    """``reason`` with the numbers that differ from one failure to the next taken out."""
    return _NUMBER.sub("N", _INSTANCE.sub("...", _HEX.sub("0x...", reason)))


def grouped(reasons: Counter) -> dict[str, int]:
    """A count by reason, as a count by ``reason_group``, most frequent first."""
    groups: Counter = Counter()
    for reason, count in reasons.items():
        groups[reason_group(reason)] += count
    return dict(sorted(groups.items(), key=lambda kv: (-kv[1], kv[0])))


def _name(fault: Fault) -> str:
    """A node-wide fault by itself (there are few), one of a request by its kind (there are many)."""
    if fault.room is not None:
        return fault.kind
    return f"{fault.kind} at {fault.at:.3f} s: {fault.detail}"


def cause(world: World, room: int) -> Fault | None:
    """The recorded fault that explains why ``room``'s request did not succeed (see the module's doc), or None."""
    start = world.arrives_at.get(room, 0.0)
    end = max((world.ended_at.get((role, room), start) for role in ("prefill", "decode")), default=start)
    own = [f for f in world.fault_log if f.room == room and f.at <= end]
    for fault in own:
        if fault.kind.startswith(OUTRIGHT):
            return fault
    for fault in world.fault_log:
        # a peer notices a crash, stall or partition only after its heartbeats miss; a failed lookup fails at once
        notice = 0.0 if fault.kind == "lookup failure" else recovery_s(world.config)
        if fault.room is None and fault.kind in NODE_WIDE and fault.at <= end and \
                fault.at + fault.lasts + notice >= start:
            return fault
    rank = {kind: i for i, kind in enumerate(LIKELIEST)}
    return min(own, key=lambda f: (rank.get(f.kind, len(rank)), f.at), default=None)


def failed_by_fault(world: World, failed: list[int]) -> dict[str, int]:
    """How many of the ``failed`` requests each injected fault explains, most first; ``WITHOUT_FAULT`` always."""
    counts: Counter = Counter({WITHOUT_FAULT: 0})
    for room in failed:
        fault = cause(world, room)
        counts[WITHOUT_FAULT if fault is None else _name(fault)] += 1
    return dict(sorted(counts.items(), key=lambda kv: (kv[0] != WITHOUT_FAULT, -kv[1], kv[0])))
