"""Replay: re-fire each journaled room through the same tables and check that the journal agrees.

For every (node, role, room) the rows are taken in version order and fired through the role's machine with no
effects run. Each row's recorded ``src``, ``dst`` and effect list must come out again; the first row that does not
is a :class:`Divergence` and the room is reported inconsistent (later rows of that room are not compared: the
replayed state no longer means anything). Missing or repeated versions are divergences too.

The result is also the operator's explanation of what happened: final state, failure reason, which trigger ended
the room, and how long it spent in each state.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from itertools import groupby

from fsm_pd.machines import MACHINES, TERMINAL, Room
from fsm_pd.machines.deadlines import explain_timeout, state_deadline
from fsm_pd.machines.receiver import KV_CHECKSUM_MISMATCH
from fsm_pd.store.causes import explain_room
from fsm_pd.store.journal import JournalRow
from fsm_pd.store.roles import PEER_ROLE, RECOMPUTE_ROLE, RECORD_ROLES


@dataclass(frozen=True, slots=True)
class Divergence:
    node: str
    role: str
    room: int
    version: int
    trigger: str
    field: str  # "src", "dst", "effects" or "version"
    expected: object  # what the tables produce now
    recorded: object  # what the journal says

    def describe(self) -> str:
        return (f"room {self.room} {self.role} ({self.node}) version {self.version} {self.trigger}: "
                f"expected {self.field} {self.expected!r}, journal has {self.recorded!r}")


@dataclass(slots=True)
class RoomReport:
    room: int
    role: str
    node: str
    final: str
    reason: str | None
    ended_by: str | None
    started_at: float
    ended_at: float
    time_in_state: dict[str, float]
    events: list[dict]
    divergence: Divergence | None = None
    replayed_state: str | None = None
    # what the prefix caches did for the room's KV (``kv_pages``): pages of the prompt, pages moved, cache hits
    pages: dict | None = None
    # the state deadline whose timer ended the room (``deadline_that_ended``): timer, state, waits_for, seconds, ...
    deadline: dict | None = None
    # what the room's other side (and the request's later attempts) tell of this side (``causes.py``): when its node
    # was last alive if it died, why it ended where its own journal cannot say, whether that end was a consequence
    # of the other side's, and its time with a prefill's compute and a dead node's silence taken out of its states
    alive_until: float | None = None
    cause: str | None = None
    consequence: bool = False
    phases: dict[str, float] | None = None

    @property
    def why(self) -> str | None:
        """The failure reason, with the deadline that ended the room explained (what it waited for, its length and
        the flag or variable that sets it), and what the other side tells of it."""
        why = self.reason
        if self.deadline is not None:
            why = f"{self.reason}: {self.deadline['explained']}"
        elif self.reason and KV_CHECKSUM_MISMATCH in self.reason:
            why = f"{self.reason}: {CHECKSUM_EXPLAINED}"
        if self.cause is not None:
            return f"{why} ({self.cause})" if why else self.cause
        return why

    @property
    def consistent(self) -> bool:
        return self.divergence is None

    @property
    def failed(self) -> bool:
        return self.final == "Failed"

    def to_dict(self) -> dict:
        out = {
            "room": self.room, "role": self.role, "node": self.node, "final": self.final, "reason": self.reason,
            "ended_by": self.ended_by, "consistent": self.consistent, "started_at": self.started_at,
            "ended_at": self.ended_at, "time_in_state": self.time_in_state, "events": self.events,
            "pages": self.pages, "deadline": self.deadline, "alive_until": self.alive_until, "cause": self.cause,
            "phases": self.phases,
        }
        if self.divergence is not None:
            out["divergence"] = asdict(self.divergence)
        return out


@dataclass(slots=True)
class ReplayResult:
    rooms: list[RoomReport] = field(default_factory=list)

    @property
    def divergences(self) -> list[Divergence]:
        return [r.divergence for r in self.rooms if r.divergence is not None]

    @property
    def consistent(self) -> bool:
        return not self.divergences

    def final_states(self) -> dict[tuple[str, str, int], str]:
        return {(r.node, r.role, r.room): r.final for r in self.rooms}


def replay(rows: Iterable[JournalRow]) -> ReplayResult:
    """Replay every room found in ``rows`` (from one journal or several merged), all in memory: small journals.

    ``replay_sides`` is the same replay over a stream of sides, for journals of any size.
    """
    groups: dict[tuple[str, str, int], list[JournalRow]] = defaultdict(list)
    for row in rows:
        groups[(row.node, row.role, row.room)].append(row)
    result = ReplayResult()
    for (node, role, room_id), room_rows in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        room_rows.sort(key=lambda r: (r.version, r.seq))
        result.rooms.append(_replay_room(node, role, room_id, room_rows))
    for _ in by_room(result.rooms):  # each room's sides explained by one another
        pass
    return result


def replay_sides(sides: Iterable[list[JournalRow]]) -> Iterator[RoomReport]:
    """Replay a stream of sides (one room on one node, rows in version order), one report per side, lazily."""
    for side in sides:
        first = side[0]
        yield _replay_room(first.node, first.role, first.room, side)


def by_room(reports: Iterable[RoomReport]) -> Iterator[list[RoomReport]]:
    """Group a room-ordered report stream into rooms: every side of one room together, each explained by the other
    (``causes.explain_room``)."""
    for _, group in groupby(reports, key=lambda r: r.room):
        yield explain_room(list(group))


def _replay_room(node: str, role: str, room_id: int, rows: list[JournalRow]) -> RoomReport:
    if role in RECORD_ROLES:
        first = rows[0]
        divergence = None
        if len(rows) != 1 or first.version != 0 or first.dst not in TERMINAL:
            divergence = Divergence(node, role, room_id, rows[-1].version, rows[-1].trigger, "record",
                                    "one row ending Success or Failed", f"{len(rows)} rows ending {rows[-1].dst}")
        return _report(node, role, room_id, rows, divergence, rows[-1].dst)
    machine = MACHINES.get(role)
    room = Room(room_id)
    divergence = None
    for expected_version, row in enumerate(rows):
        if machine is None:
            divergence = Divergence(node, role, room_id, row.version, row.trigger, "role", sorted(MACHINES), role)
            break
        if row.version != expected_version:
            divergence = Divergence(node, role, room_id, row.version, row.trigger, "version",
                                    expected_version, row.version)
            break
        decision = machine.fire(room, row.trigger, row.event)
        effects = _effect_dicts(decision.effects_json)  # described, never run
        for name, expected, recorded in (("src", decision.src, row.src), ("dst", decision.dst, row.dst),
                                         ("effects", effects, row.payload.get("effects"))):
            if expected != recorded:
                divergence = Divergence(node, role, room_id, row.version, row.trigger, name, expected, recorded)
                break
        if divergence is not None:
            break
    return _report(node, role, room_id, rows, divergence, room.state)


@lru_cache(maxsize=256)
def _effect_dicts(effects_json: str) -> list[dict]:
    """A decision's effects as the journal records them. Effects are constants of the table rows (they carry no
    per-request data), so each distinct list is decoded once; callers only compare it."""
    return json.loads(effects_json)


def _pieces(event: dict) -> str | None:
    """What a handoff between different tensor-parallel sizes moved (``docs/tensor-parallel.md``): P's ``published``
    says how many pieces, D's ``pulled`` where each came from and went."""
    pieces = event.get("pieces")
    if isinstance(pieces, int):
        return f"{pieces} pieces"
    if isinstance(pieces, list):
        return "; ".join(f"prefill shard {src} -> decode shard {dst}: {nbytes} B" for src, dst, nbytes in pieces)
    return None


def _chunks(trigger: str, event: dict) -> str | None:
    """A chunked handoff's progress (``fsm_pd/effects/chunked.py``): on P each chunk and the pages it makes final,
    then how many pieces READY announced; on D what every piece brought.

    A chunk other than the last is journaled when the model thread has queued it on the device, not when the device
    has computed it (nothing waits for it: the device runs ahead of the host), so its pages become final later, and
    a piece of them goes out once they are; a long prompt's chunks can all be queued within a fraction of a second
    of its prefill. The last chunk samples the first token, which waits for every chunk before it: its row is when
    the whole prompt was computed."""
    if trigger == "kv_ready" and event.get("piece_pages"):
        return (f"first chunk queued on the device: {event.get('final_pages', 0)} of "
                f"{len(event.get('pages') or ())} pages final once it has run, "
                f"sent in pieces of {event['piece_pages']}")
    if trigger == "kv_chunk":
        if event.get("last"):
            return f"last chunk computed: all {event.get('final_pages', 0)} pages final, trailer with the first token"
        return f"chunk queued on the device: {event.get('final_pages', 0)} pages final once it has run"
    if trigger == "piece_pulled":
        return f"piece {event.get('piece')} landed: the transfer deadline starts again"
    if trigger == "published" and event.get("chunks"):
        return f"{event['chunks']} pieces of {event.get('chunk_pages')} pages, then a trailer"
    if trigger == "pulled" and isinstance(event.get("chunks"), list):
        return f"{len(event['chunks'])} pieces ({', '.join(f'{n} B' for n in event['chunks'])}) and the trailer"
    return None


def _record(role: str, row) -> str | None:
    """What a recompute's or a peer's record says (``RECORD_ROLES``)."""
    event = row.event
    if role == RECOMPUTE_ROLE:
        took = f" in {event['seconds']:.3f} s" if isinstance(event.get("seconds"), int | float) else ""
        done = f"prompt of {event.get('prompt_len', '?')} tokens queued and prefilled on this node{took}"
        return done if row.dst == "Success" else f"{row.payload.get('reason')} ({done})"
    if role == PEER_ROLE:
        return f"after this room ended: {row.payload.get('reason')}"
    return None


# What a failed KV checksum means (``fsm_pd/effects/checksums.py``), for ``why``.
CHECKSUM_EXPLAINED = (
    "the KV in the decode node's pages after the handoff is not what the prefill node computed when it was final "
    "(crc32c, or kvmix32 on an accelerator, per piece and layer): corrupted on the wire, read from a prefill page "
    "that was reused while it was sent, or overwritten in the decode node's pool before its first decode step; no "
    "token was decoded from it, and the decode node recomputed the prompt (--on-transfer-failure recompute) or failed "
    "the request (fail)")
CHECKSUM_OUTCOMES = {
    "verified": "kv checksum verified",
    "missing": "kv checksum not verified: none from the prefill node (its --kv-checksum off, or its pool is not "
               "checksummed)",
    "other_algorithm": "kv checksum not verified: the prefill node's values are of another algorithm than this "
                       "node's (crc32c on a CPU pool, kvmix32 on an accelerator)",
    "unchecked": "kv checksum not verified: this node's pool is not checksummed",
    "off": "kv checksum not verified: --kv-checksum off",
}


def _checksum(trigger: str, event: dict) -> str | None:
    """The KV checksum of a handoff: what P announced (``published``), and what D found (``scattered``)."""
    sums = event.get("kv_checksum")
    if trigger in ("published", "pulled") and isinstance(sums, list) and sums:
        algorithm = event.get("kv_checksum_algorithm", "crc32c")
        return f"kv checksum: {algorithm} of {len(sums)} piece(s) x {len(sums[0])} layers"
    if trigger == "scattered":
        return CHECKSUM_OUTCOMES.get(event.get("kv_checksum_check"))
    return None


def _report(node, role, room_id, rows, divergence, replayed_state) -> RoomReport:
    events, time_in_state = [], {}
    final, reason, ended_by, entered_at = rows[0].src, None, None, rows[0].at
    for row in rows:
        event = {"trigger": row.trigger, "src": row.src, "dst": row.dst, "at": row.at, "version": row.version}
        if "ignored" in row.payload:
            event["ignored"] = row.payload["ignored"]
        detail = (_record(role, row) or row.event.get("reason") or row.event.get("timer") or _pieces(row.event)
                  or _chunks(row.trigger, row.event) or _checksum(row.trigger, row.event))
        if detail is not None:
            event["detail"] = detail
        if row.trigger == "kv_ready" and row.event.get("piece_pages"):  # a chunked prompt's handoff began (causes.py)
            event["chunked"] = True
        elif row.trigger == "kv_chunk" and row.event.get("last"):  # ... and its last chunk was computed
            event["last_chunk"] = True
        if route := row.event.get("route"):  # the router's reason (router/policy.py): a decode create, a local record
            event["route"] = route
            event.setdefault("detail", f"routed: {route}")
        events.append(event)
        if row.dst != row.src:
            time_in_state[row.src] = round(time_in_state.get(row.src, 0.0) + (row.at - entered_at), 6)
            entered_at = row.at
            if row.dst in TERMINAL:
                ended_by, reason = row.trigger, row.payload.get("reason")
        final = row.dst
    if final not in TERMINAL:
        time_in_state[final] = round(time_in_state.get(final, 0.0) + (rows[-1].at - entered_at), 6)
    if role in RECORD_ROLES:  # one row: no time in any state
        time_in_state = {}
    return RoomReport(room_id, role, node, final, reason, ended_by, rows[0].at, rows[-1].at, time_in_state, events,
                      divergence, replayed_state, kv_pages(role, rows), deadline_that_ended(role, rows))


def deadline_that_ended(role: str, rows) -> dict | None:
    """When a state's timer ended the room: which timer, the state it bounded, what the room waited for there, the
    length the room was created with (its ``create`` event's ``deadlines``) and the flag and variable that set it."""
    last = next((row for row in reversed(rows) if row.dst != row.src), None)
    if last is None or last.trigger != "timeout" or last.dst != "Failed":
        return None
    timer = last.event.get("timer")
    known = state_deadline(role, timer) if isinstance(timer, str) else None
    if known is None:
        return None
    created = next((row.event for row in rows if row.trigger == "create"), {})
    seconds = (created.get("deadlines") or {}).get(timer)
    seconds = float(seconds) if isinstance(seconds, int | float) else None
    return {"timer": timer, "state": last.src, "waits_for": known.waits_for, "seconds": seconds, "flag": known.flag,
            "env": known.env, "explained": explain_timeout(role, timer, seconds)}


def kv_pages(role: str, rows) -> dict | None:
    """From one side's events: the prompt's pages, how many crossed (prefill: sent; decode: received) and what the
    prefix caches held (prefill: prompt tokens it did not compute; the decode node's own leading pages). None
    before the pages were known."""
    found = {row.trigger: row.event for row in rows}
    if role == "prefill":
        pages = (found.get("kv_ready") or {}).get("pages") or (found.get("create") or {}).get("pages")
        if pages is None:
            return None
        peer = int((found.get("metadata_received") or {}).get("peer_cached_pages", 0))
        return {"pages": len(pages), "sent": len(pages) - peer, "decode_cached_pages": peer,
                "cached_tokens": int((found.get("kv_ready") or {}).get("cached_tokens", 0))}
    reserved = found.get("pages_reserved")
    if reserved is None:
        return None
    out = {"pages": len(reserved.get("pages", [])), "cached_pages": int(reserved.get("cached_pages", 0))}
    if "kv_published" in found:
        out["received"] = int(found["kv_published"].get("page_count", 0))
        out["prefill_cached_tokens"] = int(found["kv_published"].get("peer_cached_tokens") or 0)
    return out


@dataclass(slots=True)
class Summary:
    """What a streamed replay learned about every room it read, whatever it showed."""

    rooms: int = 0
    failed: int = 0  # rooms with a failed side
    divergences: list[Divergence] = field(default_factory=list)

    def count(self, sides: list[RoomReport]) -> None:
        self.rooms += 1
        self.failed += any(s.failed for s in sides)
        self.divergences.extend(s.divergence for s in sides if s.divergence is not None)

    @property
    def consistent(self) -> bool:
        return not self.divergences
