"""How long a simulated world may take to go idle, and what to say when it does not (``World.run``'s bound).

Heartbeats tick for ever, so a world with a room that never ends never goes idle: ``World.run`` would fire timers
until the test's timeout, and hypothesis could not shrink the example. Instead a run must be idle by
``settle_bound``, derived from what can still legitimately happen, else it raises ``Stuck``. A virtual second costs
a few heartbeats, so a generous bound costs nothing; what matters is that it is finite.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm_pd.sim.decode_loop import STEP_S

if TYPE_CHECKING:
    from fsm_pd.sim.world import World


class Stuck(AssertionError):
    """The world did not go idle within its bound: something never ends (an assertion, so that a property test
    reports it as a failure and shrinks it)."""


def settle_bound(world: World) -> float:
    """The longest ``world``, left alone, may take from now to go idle: what is scheduled to begin (requests,
    restarts) begins; every room then ends within the sum of its role's deadlines (one deadline per state: the
    machines' guarantee); and what rooms leave behind finishes: a frame the network delays (up to ``max_delay_s``),
    a pull that reports late (``slow_pulls_s``, plus up to 2 s drawn), the model thread's queue (its head, then a few
    jobs per room at the current delay), a decode's run."""
    c, now = world.config, world.clock.now()
    room_s = max(sum(c.prefill_deadlines.values()), sum(c.decode_deadlines.values()))
    slots = [s for s in (world.prefill, world.decode) if s.alive]
    models = [s.instance.model for s in slots]
    rooms = world.pending_arrivals + sum(not r.terminal for s in slots for r in s.instance.node.rooms.values())
    backlog = sum(max(0.0, m.due_at - now) for m in models)
    backlog += (sum(m.queued() for m in models) + 4 * rooms) * world.model_delay
    stalled = max([0.0, *(s.instance.frozen_until - now for s in slots)])  # a stalled node's clocks wait (none up: 0)
    # the decode loop: every request there and every room still open decodes in turn at worst (retractions)
    decoding = world.decode.instance.scheduler.live() if world.decode.alive else 0
    decode_s = (decoding + rooms + 1) * c.decode_tokens * STEP_S * 2
    after_rooms = stalled + world.network.max_delay_s + world.plan.slow_pulls_s + 2.0 + decode_s + backlog
    return max(0.0, world.last_start - now) + room_s + after_rooms + 1.0


def still_going(world: World, limit: float) -> str:
    """What keeps ``world`` from going idle: the rooms that never ended and the work still pending."""
    open_rooms = [f"{slot.role} room {r.room} {r.state} (since t={slot.instance.created.get(r.room, 0.0):.3f})"
                  for slot in (world.prefill, world.decode) if slot.alive
                  for r in slot.instance.node.rooms.values() if not r.terminal]
    return (f"not idle at t={world.clock.now():.3f}, the bound was t={limit:.3f}: {len(open_rooms)} room(s) never "
            f"ended {open_rooms[:5]}, {world.sched.in_flight} callback(s) of work pending, "
            f"{world.pending_arrivals} arrival(s) and {world.restarts_pending} restart(s) to come")
