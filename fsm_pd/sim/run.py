"""``fsm-pd simulate``: run N requests through the simulated cluster and summarise what happened."""

from __future__ import annotations

import os
from collections import Counter

from fsm_pd.sim.attribution import WITHOUT_FAULT, failed_by_fault, grouped
from fsm_pd.sim.invariants import overdue_rooms, overdue_states, ownership_violations
from fsm_pd.sim.outcomes import corruption_served, outcome_disagreements
from fsm_pd.sim.world import SimConfig, World


def schedule_requests(world: World) -> None:
    """Poisson arrivals with prompt lengths from 1 token to many pages; a crash of either node, and a stall of one,
    if the plan wants them."""
    config, at = world.config, 0.0
    for room in range(1, config.requests + 1):
        at += world.rng.expovariate(1.0 / config.mean_interarrival)
        world.add_request(room, world.rng.randint(1, config.max_prompt), at)
    if world.plan.prefill_crash():
        crash_at = world.rng.random() * at
        world.clock.call_at(crash_at, world.crash_prefill)
    if world.plan.decode_crash():
        crash_at = world.rng.random() * at
        world.clock.call_at(crash_at, lambda: world.crash("decode", restart_after=world.config.restart_after,
                                                          after_commit=True))
    stall_s = world.plan.stall()
    if stall_s:
        role, stall_at = world.rng.choice(("prefill", "decode")), world.rng.random() * at
        world.clock.call_at(stall_at, lambda: world.stall(role, stall_s))


def simulate(config: SimConfig, journal_dir: str | os.PathLike | None = None, durability: str = "normal") -> dict:
    world = World(config, journal_dir, durability)
    overdue: list[str] = []
    world.probes.append(lambda: overdue.extend(overdue_states(world)[:1]))  # at every instant the world settles
    try:
        schedule_requests(world)
        world.run()
        summary = summarize(world)
        summary["leaks"]["violations"] += overdue[:5]
        return summary
    finally:
        world.close()


def summarize(world: World) -> dict:
    """What the client saw (the decode side's outcome), what the prefill side saw, and what leaked; the failures'
    reasons grouped with their numbers taken out, and the injected fault behind each failed request
    (``attribution.py``)."""
    decode_failed, prefill_failed = Counter(), Counter()
    succeeded, failed = 0, []
    live = world.live_rooms()
    decode = world.decode.live_rooms()
    for room in world.requests:
        d = decode.get(room)
        if d is not None and d.state == "Success":
            succeeded += 1
        else:
            # a room without a reason was left unfinished by a process that died without a journal to recover from
            decode_failed["never reached decode" if d is None else d.reason or f"lost in {d.state}"] += 1
            failed.append(room)
        p = live.get((world.prefill_id, "prefill", room))
        if p is not None and p.state == "Failed":
            prefill_failed[p.reason] += 1
    unfinished = [r.room for s in (world.prefill, world.decode) for r in s.live_rooms().values() if not r.terminal]
    return {
        "requests": len(world.requests),
        "seed": world.config.seed,
        "fault_rate": world.config.fault_rate,
        "succeeded": succeeded,
        "failed": len(world.requests) - succeeded,
        "failed_by_reason": grouped(decode_failed),
        "failed_by_fault": (by_fault := failed_by_fault(world, failed)),
        "failed_without_fault": by_fault[WITHOUT_FAULT],
        "prefill_failed_by_reason": grouped(prefill_failed),
        "prefill_crashes": world.crashes,
        "decode_crashes": world.decode.crashes,
        "messages": dict(sorted(world.network.counts.items())),
        "faults": dict(sorted(Counter(f.kind for f in world.fault_log).items())),
        "unfinished_rooms": len(unfinished),
        "leaks": {
            "staging_buffers_held": len(world.ledger.holdings("staging")),
            "pages_reserved": len(world.ledger.holdings("pages")),
            "transfer_entries_open": len(world.ledger.holdings("entry")),
            "pulled_buffers_held": len(world.ledger.holdings("pulled")),
            "violations": ownership_violations(world) + overdue_rooms(world) + outcome_disagreements(world)
            + corruption_served(world),
        },
        "virtual_seconds": round(world.clock.now(), 6),
        "shared_pool": world.shared_pool,
    }
