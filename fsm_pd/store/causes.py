"""What one side of a room cannot say about itself, read from the room's other side (``explain_room``) and from the
request's later attempts (``explain_retries``).

A node journals what it saw. What it cannot see:

- **That it died.** Its journal just stops; a restart fails what it finds open with ``node restarted``, later. The
  side then ends where its last event was journaled alive (``alive_until``): the restart's row if it restarted, its
  last row if it never did and the other side's heartbeats found it dead, either while its room was open
  (``peer_failed``) or after the room had ended there on its own (a pull that broke off when the process died: the
  other node's ``peer`` record, ``store/roles.py``).
- **Who closed its request.** An HTTP request that closes before its answer aborts the room (``REQUEST_CLOSED``;
  nodes before it wrote ``aborted by the client``): the client's doing, or a router's. When the other side of the
  room had already failed or died, the router closed it: a router ends an attempt's other leg when one fails. When
  the request has a later attempt, the router closed it to retry. (A router that reuses a worker for the retry aborts
  the old attempt there by name: ``RETRY_ABORT``.)
- **Where its time went while it waited on the other side.** A chunked prompt is handed over while it is computed:
  the prefill node enters Transferring after its first chunk and the decode node pulls each chunk as it becomes
  final, so until the last chunk is computed (``kv_chunk`` with ``last``) both sides' Transferring is the prefill's
  compute, not the network's time. After a side's node died, the other side's time waits on a dead peer.
  ``phases`` splits the time in states at those points (compared across nodes by their clocks: on different
  machines, within their skew).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fsm_pd.store.roles import PEER_ROLE

if TYPE_CHECKING:
    from fsm_pd.store.replay import RoomReport

RESTARTED = "node restarted"  # the reason a restarted node fails the rooms it finds open (effects/node.py, recover)
# The abort of a request whose HTTP request closed first (api/runner.py), and what nodes journaled for it before
REQUEST_CLOSED = "aborted: its HTTP request was closed before it finished"
CLOSED_BEFORE = "aborted by the client"
# The abort the built-in router sends for a failed attempt's leg on a worker its retry uses (api/sglang_routes.py)
RETRY_ABORT = "aborted by the router for a retry (POST /abort_request for this attempt's room)"
ABORT_BY_NAME = "aborted by POST /abort_request"  # the same without a room: a client's own abort

# the pieces of time a side spends outside its own states' work (``RoomReport.phases``)
PREFILL_COMPUTE = "prefill compute"  # the prefill node computing a chunked prompt's later chunks
NODE_DOWN = "node down"  # this side's node died: from its last journaled event to its restart
PEER_DOWN = "peer down"  # the other side's node died: from its last journaled event to this side's end


def explain_room(sides: list[RoomReport]) -> list[RoomReport]:
    """Set ``alive_until``, ``cause`` and ``phases`` on the sides of one room (a prefill and a decode side, or one
    of them); returns ``sides``."""
    for side in sides:
        side.alive_until = _died(side, _peer(side, sides), sides)
    for side in sides:
        peer = _peer(side, sides)
        side.cause, side.consequence = _cause(side, peer, sides)
        side.phases = _phases(side, peer)
    return sides


def explain_retries(attempts: Sequence) -> None:
    """A side of an attempt aborted because its request was closed, in a request that has a later attempt: the router
    closed it to retry (a client that leaves gets no retry)."""
    for i, attempt in enumerate(attempts[:-1]):
        following = attempts[i + 1]
        for side in attempt.sides:
            if side.ended_by == "abort" and _closed(side) and "retr" not in (side.cause or ""):
                retry = f"the router retried the request: attempt {i + 2}, room {following.room}"
                side.cause = f"{side.cause}; {retry}" if side.cause else f"closed by the router: {retry}"
                side.consequence = True


def _peer(side: RoomReport, sides: list[RoomReport]) -> RoomReport | None:
    return next((s for s in sides if s is not side and {s.role, side.role} == {"prefill", "decode"}), None)


def _found_dead(peer: RoomReport | None, sides: list[RoomReport]) -> RoomReport | None:
    """The record the other side's node wrote when, after the room had ended there, it found this side's process
    dead or replaced (``PEER_ROLE``)."""
    if peer is None:
        return None
    return next((s for s in sides if s.role == PEER_ROLE and s.node == peer.node), None)


def _died(side: RoomReport, peer: RoomReport | None, sides: list[RoomReport]) -> float | None:
    events = side.events
    if side.ended_by == "error" and side.reason and side.reason.endswith(RESTARTED) and len(events) > 1:
        return events[-2]["at"]
    if side.final not in ("Success", "Failed") and peer is not None and (
            peer.ended_by == "peer_failed" or _found_dead(peer, sides) is not None):
        return events[-1]["at"]
    return None


def _closed(side: RoomReport) -> bool:
    return side.reason in (REQUEST_CLOSED, CLOSED_BEFORE)


def _since(side: RoomReport, at: float) -> str:
    """``at`` said from where ``side`` stands: so long into its room, or before it began."""
    delta = at - side.started_at
    return f"{_seconds(delta)} into this side" if delta >= 0 else f"{_seconds(-delta)} before this side began"


def _last_alive(side: RoomReport) -> str:
    last = next(e for e in reversed(side.events) if e["at"] <= side.alive_until)
    return f"after its {last['trigger']}, {_since(side, side.alive_until)}"


def _cause(side: RoomReport, peer: RoomReport | None, sides: list[RoomReport]) -> tuple[str | None, bool]:
    """What the other side says of this side's end, and whether that end was a consequence of the other side's."""
    if side.alive_until is not None:
        died = f"its node died: its journal stops {_last_alive(side)}"
        if side.final == "Failed":
            return f"{died}, and the node failed the room when it restarted", False
        if peer.ended_by == "peer_failed":
            return f"{died}; the {peer.role} node found it dead ({peer.reason})", False
        found = _found_dead(peer, sides)
        return (f"{died}; the {peer.role} node found it dead {_seconds(found.started_at - peer.ended_at)} after its "
                f"side had ended ({found.reason})"), False
    if side.reason == RETRY_ABORT:
        return None, True  # the reason says it
    if side.ended_by != "abort" or not _closed(side) or peer is None:
        return None, False
    if peer.alive_until is not None and peer.alive_until <= side.ended_at:
        return (f"closed by the router: the {peer.role} node had died (its journal stops "
                f"{_since(side, peer.alive_until)})"), True
    if peer.failed and peer.ended_at <= side.ended_at:
        return f"closed by the router: the {peer.role} side had failed ({peer.reason})", True
    return None, False


def _compute_until(prefill: RoomReport | None) -> float | None:
    """When a chunked prompt's last chunk was computed on the prefill side (its last event, if it never was)."""
    if prefill is None or not any(e.get("chunked") for e in prefill.events):
        return None
    last = next((e["at"] for e in prefill.events if e.get("last_chunk")), None)
    return last if last is not None else prefill.events[-1]["at"]


def _phases(side: RoomReport, peer: RoomReport | None) -> dict[str, float] | None:
    """``time_in_state`` with the time of a prefill's compute, a dead node and a dead peer taken out of the states
    it fell in; None when there is none (the states say it all)."""
    compute = _compute_until(side if side.role == "prefill" else peer)
    down = side.alive_until
    peer_down = peer.alive_until if peer is not None and peer.alive_until is not None else None
    cuts = sorted(t for t in (compute, down, peer_down) if t is not None)
    if not cuts:
        return None
    phases: dict[str, float] = {}
    for state, start, end in _intervals(side):
        bounds = [start, *(t for t in cuts if start < t < end), end]
        for a, b in zip(bounds, bounds[1:], strict=False):
            if down is not None and a >= down:
                name = NODE_DOWN
            elif peer_down is not None and a >= peer_down:
                name = PEER_DOWN
            elif state == "Transferring" and compute is not None and b <= compute:
                name = "compute" if side.role == "prefill" else PREFILL_COMPUTE
            else:
                name = state
            phases[name] = round(phases.get(name, 0.0) + (b - a), 6)
    return phases


def _intervals(side: RoomReport) -> list[tuple[str, float, float]]:
    """(state, entered, left) of every state the side was in, the last open one up to its last event."""
    events = side.events
    out, state, entered = [], events[0]["src"], events[0]["at"]
    for e in events:
        if e["dst"] != e["src"]:
            out.append((state, entered, e["at"]))
            state, entered = e["dst"], e["at"]
    if state not in ("Success", "Failed"):
        out.append((state, entered, events[-1]["at"]))
    return out


def _seconds(value: float) -> str:
    return f"{value * 1000:.1f}ms" if value < 1 else f"{value:.2f}s"
