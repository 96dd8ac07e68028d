"""The simulation's invariants, checked after every step by the property suite (and at the end of ``simulate``).

- ownership: every page reservation, staging buffer, transfer entry and pulled buffer is freed exactly once (the
  ledger records every attempt), and no write reaches a page after its ``FreePages``;
- no leaks: once the world is quiet, nothing is held for a room that has ended, and every page of either pool is
  free, a room's or the prefix cache's, its cache locks those of the live requests (``page_accounting``); a page
  a live request's cached prefix uses is never freed or handed to another room
  (``allocator.RecordingAllocator``);
- page lifetimes: a page goes back to the free list only after its writer and every reader have finished, and reads
  and writes reach only the room's pages (``allocator.RecordingAllocator``, at every event);
- liveness: every room ends within the sum of its role's deadlines (pushed out by as much as progress restarted
  them: a chunked handoff's chunks), and stays in no state longer than that state's deadline since it was last
  armed, plus the slack (``overdue_states``, at every settle point);
- both sides of a room agree, and no corrupted handoff is decoded (``fsm_pd.sim.outcomes``);
- peers: no room stays bound to a dead peer process longer than the heartbeats take to notice;
- the live state of every room equals the replay of its node's journal, and every journaled decision is the one
  the literal tables give (``fsm_pd.sim.oracle``: read directly, not through ``fire``);
- liveness: once the faults are over and every process has been up long enough to be known to its peer, every new
  request succeeds on both sides within a bound (``recovery_s``, ``handoff_bound_s``).
"""

from __future__ import annotations

from fsm_pd.sim.oracle import check_rows
from fsm_pd.sim.world import SimConfig, World
from fsm_pd.store import replay
from fsm_pd.store.journal import JournalRow
from fsm_pd.store.reader import JournalReader
from fsm_pd.store.roles import RECORD_ROLES


def ownership_violations(world: World) -> list[str]:
    return list(world.ledger.violations)


def leaks(world: World) -> list[str]:
    """Holdings of live processes whose room has ended (or is unknown). Meaningful when ``world.quiet()``."""
    found = []
    for h in world.ledger.holdings():
        inst = h.instance
        room = inst.node.rooms.get(h.room)
        if room is None or room.terminal:
            state = "gone" if room is None else room.state
            found.append(f"{h.kind} {h.key!r} of room {h.room} on {inst.name} still held, room {state} "
                         f"(held since t={h.since:.4f})")
    return found


def page_accounting(world: World) -> list[str]:
    """Both nodes' pools, once quiet: every page is free, a live room's, or the prefix cache's (never two of these,
    never none), and each cached page is locked exactly as often as live requests use it (none when no request is
    live). A page freed or handed on while a live request's prefix locks it is caught when it happens (``kv.py``).
    A pool both roles share (``shared_pool.py``) is checked once, across both roles' rooms."""
    pools = {}
    for slot in (world.prefill, world.decode):
        if slot.alive:
            allocator = slot.instance.scheduler.allocator
            pools.setdefault(id(getattr(allocator, "shared", allocator)), allocator)
    return [problem for allocator in pools.values() for problem in allocator.accounting()]


def overdue_rooms(world: World) -> list[str]:
    now, found = world.clock.now(), []
    for slot in (world.prefill, world.decode):
        if not slot.alive:
            continue
        inst = slot.instance
        budget = sum(inst.node.deadlines.values())
        for room in inst.node.rooms.values():
            created = inst.created.get(room.room)
            if created is not None:  # a deadline restarted by progress (a chunk) pushes the room's bound out
                created += world.extended.get((inst.name, room.room), 0.0)
            if not room.terminal and created is not None and now - created > budget + 1e-9:
                found.append(f"{slot.role} room {room.room} is still {room.state} {now - created:.3f} s after it "
                             f"was created; its deadlines add up to {budget} s")
    return found


def bound_to_dead_peers(world: World) -> list[str]:
    """Rooms still bound (``PeerWatch``) to a peer instance that died more than ``max_failures + 1`` heartbeat
    intervals ago, counted from the latest of its death, the room's binding and the last frame of it that arrived
    (a frame the network delayed past its sender's death still counts as heard), plus the longest stall: a node
    stopped (SIGSTOP) meanwhile runs its heartbeat timers only when it resumes, as ``state_slack_s`` says."""
    config, now, found = world.config, world.clock.now(), []
    grace = (config.heartbeat_max_failures + 1) * config.heartbeat_interval + 0.01 + world.longest_stall
    for slot in (world.prefill, world.decode):
        if not slot.alive:
            continue
        for room, (addr, instance, since) in slot.instance.peers.bound().items():
            peer = world.instances.get(instance)
            if peer is None or peer.died_at is None:
                continue
            if now - max(peer.died_at, since, world.network.last_heard.get(instance, since)) > grace:
                found.append(f"{slot.role} room {room} is still bound to {peer.name} at {addr}, dead since "
                             f"t={peer.died_at:.3f} (bound at t={since:.3f}, now t={now:.3f})")
    return found


class JournalTail:
    """One journal followed while it is written: its reader stays open, and each read fetches only the rows
    committed since the last (the property suite reads both journals after every step)."""

    def __init__(self, path):
        self.path, self.reader, self.rows = path, None, []

    def read(self) -> list[JournalRow]:
        if self.reader is None:
            if not self.path.exists():
                return self.rows
            self.reader = JournalReader(self.path)
        self.rows.extend(self.reader.rows(after=self.rows[-1].seq if self.rows else 0))
        return self.rows

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def journal_rows(world: World) -> list[JournalRow]:
    """Every row of both journals, in commit order per journal."""
    if world.journal_dir is None:
        return []
    rows: list[JournalRow] = []
    for role in ("prefill", "decode"):
        tail = world.journal_tails.get(role)
        if tail is None:
            tail = world.journal_tails[role] = JournalTail(world.journal_dir / f"{role}.db")
        rows.extend(tail.read())
    return rows


def journal_disagreements(world: World, rows: list[JournalRow] | None = None) -> list[str]:
    """Replay both journals; every room must replay consistently to the state (and version) it has live."""
    if world.journal_dir is None:
        return []
    result = replay(journal_rows(world) if rows is None else rows)
    found = [d.describe() for d in result.divergences]
    # a record (a peer found dead after its room ended: ``store/roles.py``) is no live room: replay checks its shape
    replayed = {(r.node, r.role, r.room): (r.final, len(r.events)) for r in result.rooms if r.role not in RECORD_ROLES}
    live = {key: (room.state, room.version) for key, room in world.live_rooms().items()}
    for key in sorted(set(replayed) | set(live)):
        if replayed.get(key) != live.get(key):
            found.append(f"{key}: live (state, version) {live.get(key)}, journal replays to {replayed.get(key)}")
    return found


def table_disagreements(world: World, rows: list[JournalRow] | None = None) -> list[str]:
    """Every journaled decision, decided again by the oracle from the literal tables; and every live room where the
    oracle leaves it (state, version, reason). Replay cannot see a wrong decision: it repeats it."""
    if world.journal_dir is None:
        return []
    found, rooms = check_rows(journal_rows(world) if rows is None else rows)
    for key, room in world.live_rooms().items():
        oracle = rooms.get(key)
        want = None if oracle is None else (oracle.state, oracle.version, oracle.reason)
        if want != (room.state, room.version, room.reason):
            found.append(f"{key}: live (state, version, reason) {(room.state, room.version, room.reason)}, "
                         f"the tables give {want}")
    return found


def recovery_s(config: SimConfig) -> float:
    """How long after the last fault (faults off, partitions healed, crashed nodes started again, the fault phase's
    rooms ended) until a new request must succeed: a peer that died is declared dead, or one that was replaced is
    seen to be, within ``max_failures + 1`` heartbeat intervals (misses are counted per interval, and the last
    answer may have come just after a tick). By then each side has dropped what it knew of the other's old process
    (``PeerWatch``'s ``forget``: the resolver's cached lookup among it), so nothing stale is left to fail on."""
    return (config.heartbeat_max_failures + 1) * config.heartbeat_interval


def handoff_bound_s(config: SimConfig) -> float:
    """How long a request may take, from reaching the nodes to Success on both sides, in a cluster without faults:
    the shortest deadline of either role. No step of a healthy handoff waits on a timer (each is a lookup, a
    message, a gather, a pull or a scatter: milliseconds here), so a request still unfinished then is waiting for
    something that only a deadline would end: a lookup, a message or a peer that will not come."""
    return min(*config.prefill_deadlines.values(), *config.decode_deadlines.values())


def not_succeeded(world: World, rooms: list[int]) -> list[str]:
    """The rooms among ``rooms`` that have not reached Success on both sides, and where each side stands."""
    found = []
    for room in rooms:
        sides = {}
        for slot in (world.prefill, world.decode):
            state = slot.live_rooms().get(room)
            sides[slot.role] = "never created" if state is None else (
                state.state if state.reason is None else f"{state.state} ({state.reason})")
        if set(sides.values()) != {"Success"}:
            found.append(f"room {room}: prefill {sides['prefill']}, decode {sides['decode']}")
    return found


def state_slack_s(world: World) -> float:
    """How far past its state's deadline a room may still be in that state: the longest stall (SIGSTOP) injected,
    since a stopped process's timers fire only when it resumes, plus 1 ms for the float sums. Nothing else delays
    a timeout: the simulator steps every node at the instant a timer fires."""
    return world.longest_stall + 0.001


def overdue_states(world: World) -> list[str]:
    """Rooms that have run under one deadline (the timer the machine arms on entering a state, or hands over to
    within it: ``DEADLINES`` and ``HANDOVERS`` of its role, its length from the room's recorded deadlines) longer
    than that deadline plus the slack. Checked at every instant the world settles (``World.probes``), on both sides,
    for every state; only the rooms whose deadline has passed are looked at (``armed.ArmedDeadlines``)."""
    now, slack = world.clock.now(), state_slack_s(world)
    alive = {slot.instance.name: slot for slot in (world.prefill, world.decode) if slot.alive}
    found = []
    for (instance, room_id), timer, since, limit in world.armed.overdue(now, slack, alive):
        slot = alive[instance]
        room = slot.instance.node.rooms.get(room_id)
        state = room.state if room is not None else "gone"
        found.append(f"{slot.role} room {room_id} has been {state} under its {timer} deadline for {now - since:.3f} "
                     f"s (since t={since:.3f}); the deadline is {limit:g} s, the slack {slack:g} s")
    return found
