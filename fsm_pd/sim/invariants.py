"""The simulation's invariants, checked after every step by the property suite (and at the end of ``simulate``).

- ownership: every page reservation, staging buffer, transfer entry and pulled buffer is freed exactly once (the
  ledger records every attempt), and no write reaches a page after its ``FreePages``;
- no leaks: once the world is quiet, nothing is held for a room that has ended;
- liveness: every room ends within the sum of its role's deadlines;
- peers: no room stays bound to a dead peer process longer than the heartbeats take to notice;
- the live state of every room equals the replay of its node's journal.
"""

from __future__ import annotations

from fsm_pd.sim.world import World
from fsm_pd.store import read_journal, replay


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


def overdue_rooms(world: World) -> list[str]:
    now, found = world.clock.now(), []
    for slot in (world.prefill, world.decode):
        if not slot.alive:
            continue
        inst = slot.instance
        budget = sum(inst.node.deadlines.values())
        for room in inst.node.rooms.values():
            created = inst.created.get(room.room)
            if not room.terminal and created is not None and now - created > budget + 1e-9:
                found.append(f"{slot.role} room {room.room} is still {room.state} {now - created:.3f} s after it "
                             f"was created; its deadlines add up to {budget} s")
    return found


def bound_to_dead_peers(world: World) -> list[str]:
    """Rooms still bound (``PeerWatch``) to a peer instance that died more than ``max_failures + 1`` heartbeat
    intervals ago (or was bound that long ago, if it was bound to an instance already dead)."""
    config, now, found = world.config, world.clock.now(), []
    grace = (config.heartbeat_max_failures + 1) * config.heartbeat_interval + 0.01  # + the pong's latency
    for slot in (world.prefill, world.decode):
        if not slot.alive:
            continue
        for room, (addr, instance, since) in slot.instance.peers.bound().items():
            peer = world.instances.get(instance)
            if peer is None or peer.died_at is None:
                continue
            if now - max(peer.died_at, since) > grace:
                found.append(f"{slot.role} room {room} is still bound to {peer.name} at {addr}, dead since "
                             f"t={peer.died_at:.3f} (bound at t={since:.3f}, now t={now:.3f})")
    return found


def journal_disagreements(world: World) -> list[str]:
    """Replay both journals; every room must replay consistently to the state (and version) it has live."""
    if world.journal_dir is None:
        return []
    rows = []
    for role in ("prefill", "decode"):
        path = world.journal_dir / f"{role}.db"
        if path.exists():
            rows.extend(read_journal(path))
    result = replay(rows)
    found = [d.describe() for d in result.divergences]
    replayed = {(r.node, r.role, r.room): (r.final, len(r.events)) for r in result.rooms}
    live = {key: (room.state, room.version) for key, room in world.live_rooms().items()}
    for key in sorted(set(replayed) | set(live)):
        if replayed.get(key) != live.get(key):
            found.append(f"{key}: live (state, version) {live.get(key)}, journal replays to {replayed.get(key)}")
    return found
