"""Property suite: hypothesis drives the simulation of the real handlers and checks the invariants after every step.

The nodes are the production code (``NodeCore``, ``Node``, ``PrefillEffects``, ``DecodeEffects``, the engines'
admission and prefix caches: ``take_prefill_batch``, ``Preallocation``, ``PrefixCache``; ``ThreadedResolver`` over
``PrefillResolver``, ``HoldTable``, ``LayerStream``, ``PeerWatch``, the journals); only the ports are simulated
(``fsm_pd.sim``). Rules: requests (prompts sharing prefixes), and requests under a room already used; message faults
(drop, duplicate, delay, reorder) and partitions; failed pulls and bootstrap lookups; slow pulls and a pull that
succeeds after its room ended; a client leaving at a chosen moment of its transfer (also half-way through a
streamed scatter); a slow model thread; client aborts on either side; a crash of either node, now or between
journal commit and effects, restarting later or at once (a peer instance replaced), or down long enough to be
declared dead; a stall (SIGSTOP) of either node; a pull whose bytes are corrupted; a cache flush; time passing. Each
world also draws whether P sends from its pool, prefills in chunks (handed off chunk by chunk), and its 64-page decode
pool makes the decode loop retract. ``TestSharedPool`` runs the same rules with both roles one process over one pool,
whose handoffs move page ownership (``--role pd``: ``SharedPoolMachine``).

After every step (``fsm_pd.sim.invariants``): every page reservation, staging buffer, transfer entry and pulled
buffer is freed exactly once (every attempt is recorded); no write reaches a page after its ``FreePages``; nothing is
held for an ended room once the world is quiet; every room ends within the sum of its deadlines; no room stays bound
to a dead peer instance longer than the heartbeats take to notice (three intervals); no page a live request's cached
prefix uses is freed or handed on, and once quiet every page is free, a room's or cached, locked as often as live
requests use it; no page goes back to the free list before its writer and readers finished (a send from the pool,
a chunk's gather, a streamed scatter, a recompute); no room stays in a state past its deadline plus the slack; P's
and D's outcomes agree or a recorded fault explains them; no corrupted handoff is decoded; the live rooms equal the
replay of the journals, and every journaled decision is the one the literal tables give (``fsm_pd.sim.oracle``); no node
accepts a room it has used, and a terminal room never changes.

At teardown, the liveness phase: the faults end, every node is up (``World.heal``), time runs until everything has
ended and been freed (bounded: a room that never ends raises ``Stuck``); after ``recovery_s`` a burst of new
requests must all reach Success on both sides within ``handoff_bound_s`` (``docs/simulation.md`` derives both).

Profiles: the default is derandomized and sized for CI (about half a minute on two cores). Set
``FSM_PD_PROPERTY_PROFILE=long`` for a randomized search twenty times larger (``FSM_PD_PROPERTY_EXAMPLES`` overrides
the number of examples of either).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fsm_pd.machines.states import STATE_NAMES, TERMINAL
from fsm_pd.sim import SimConfig, World
from fsm_pd.sim.faults import MESSAGE_FATES
from fsm_pd.sim.invariants import (
    bound_to_dead_peers,
    handoff_bound_s,
    journal_disagreements,
    journal_rows,
    leaks,
    not_succeeded,
    overdue_rooms,
    overdue_states,
    ownership_violations,
    page_accounting,
    recovery_s,
    table_disagreements,
)
from fsm_pd.sim.outcomes import corruption_served, outcome_disagreements

PROFILES = {
    # ci: 50 examples find the planted bugs 100 did (a room reused after a restart, found through a crash, a burst
    # and an outage; a streamed scatter not cancelled by its room's free, found in the first 5)
    "ci": {"max_examples": 50, "stateful_step_count": 40, "derandomize": True},
    "long": {"max_examples": 1000, "stateful_step_count": 80, "derandomize": False},
}
# the liveness phase's requests: sent at once (they share one bootstrap lookup), from one page to many
LIVENESS_PROMPTS = (1, 40, 300, 17, 120)


def _decode_pulls(world: World) -> list[int]:
    """Decode rooms whose pull is under way (the production handler's own record)."""
    return sorted(world.decode.instance.effects.pending) if world.decode.alive else []


class SimulationMachine(RuleBasedStateMachine):
    # split: (prefill tp, decode tp); a handoff between different ones is a transfer of several pieces
    @initialize(seed=st.integers(0, 2**16), background_faults=st.sampled_from([0.0, 0.0, 0.05, 0.2]),
                split=st.sampled_from([(1, 1), (1, 1), (2, 1), (1, 2)]), prefill_pages=st.sampled_from([24, 64]))
    def start(self, seed, background_faults, split, prefill_pages):
        self.begin(SimConfig(requests=0, seed=seed, fault_rate=background_faults, num_pages=64, decode_tokens=256,
                             prefill_pages=prefill_pages, prefill_tp=split[0], decode_tp=split[1]))

    def begin(self, config: SimConfig) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fsm-pd-prop-"))
        self.world = World(config, self.dir, durability="off")
        self.next_room = 1
        self.terminal_seen: dict[tuple[str, int], str] = {}
        self.instant_violations: list[str] = []
        self.world.probes.append(lambda: self.instant_violations.extend(bound_to_dead_peers(self.world)))
        self.world.probes.append(lambda: self.instant_violations.extend(overdue_states(self.world)))

    # --- requests and clients ---
    @rule(prompt_len=st.integers(1, 300))
    def request(self, prompt_len):
        self.world.add_request(self.next_room, prompt_len, at=self.world.clock.now() + 0.001)
        self.next_room += 1

    @rule(lengths=st.lists(st.integers(1, 300), min_size=2, max_size=6))
    def burst(self, lengths):
        """Requests at once (turns of conversations, a shared system prompt): the pools run short, the prefix
        caches evict while live requests lock their prefixes."""
        at = self.world.clock.now() + 0.001
        for prompt_len in lengths:
            self.world.add_request(self.next_room, prompt_len, at=at)
            self.next_room += 1

    @precondition(lambda self: self.next_room > 1)
    @rule(prompt_len=st.integers(1, 300), data=st.data())
    def reuse_room(self, prompt_len, data):
        """A client sends a new request under a bootstrap room already used (a retry, two clients drawing the same
        room): each node must refuse it, whether the first is under way, ended, or from before a restart."""
        room = data.draw(st.integers(1, self.next_room - 1))
        self.world.add_request(room, prompt_len, at=self.world.clock.now() + 0.001)

    @precondition(lambda self: self.next_room > 1)
    @rule(side=st.sampled_from(["prefill", "decode"]), data=st.data())
    def abort(self, side, data):
        room = data.draw(st.integers(1, self.next_room - 1))
        self.world.abort(side, room, "client went away")

    # --- the network, the data plane, the bootstrap server ---
    @rule(fate=st.sampled_from(MESSAGE_FATES))
    def next_message(self, fate):
        self.world.plan.forced_messages.append(fate)

    @rule(seconds=st.sampled_from([0.5, 2.5, 8.0]))
    def partition(self, seconds):
        self.world.network.partition(seconds)

    @rule()
    def fail_next_pull(self):
        self.world.plan.fail_next_pull += 1

    @rule()
    def corrupt_next_pull(self):
        """A bit of the next pull's KV flips on the way: D's checksum must catch it before decode."""
        self.world.plan.corrupt_next_pull += 1

    @rule()
    def fail_next_bootstrap_lookup(self):
        self.world.plan.fail_next_resolve += 1

    @rule(seconds=st.sampled_from([0.0, 0.05, 1.0, 7.0]))
    def slow_pulls(self, seconds):
        """Pulls take this long between having every byte and reporting it."""
        self.world.plan.slow_pulls_s = seconds

    @rule(prompt_len=st.integers(1, 300), moment=st.sampled_from(["pulling", "streaming", "landed", "scattering"]))
    def client_leaves_during_the_transfer(self, prompt_len, moment):
        """A request runs until a chosen moment of its decode transfer, then its client leaves: while the pull runs
        (``pulling``), once a streamed scatter has handed some layers but not all to the model thread
        (``streaming``: the rest may land after the pages were freed), once it has every byte but has not reported
        (``landed``: if it succeeds now, it succeeds for a room that has ended), or once it reported and the scatter
        is queued on the model thread (``scattering``)."""
        world, room = self.world, self.next_room
        self.request(prompt_len)

        def reached() -> bool:
            decode = world.decode.instance
            found = decode.node.rooms.get(room)
            if not world.decode.alive or (found is not None and found.terminal):
                return True  # it will never get there
            if moment == "scattering":
                return found is not None and "pulled" in found.seen
            if room not in decode.effects.pending:
                return False
            if moment == "streaming":
                stream = decode.effects.streams.get(room)
                return stream is None or (stream.submitted > 0 and not stream.complete)  # None: it never streams
            return moment == "pulling" or any(h.room == room for h in world.ledger.holdings("pulled"))

        world.run_until(reached)
        found = world.decode.instance.node.rooms.get(room)
        if world.decode.alive and found is not None and not found.terminal:
            world.abort("decode", room, "client went away")

    @rule(role=st.sampled_from(["prefill", "decode"]))
    def flush_cache(self, role):
        self.world.flush_cache(role)

    @rule(delay=st.sampled_from([0.0005, 0.01, 0.5, 4.0]))
    def slow_model_thread(self, delay):
        self.world.model_delay = delay

    # --- processes ---
    @rule(role=st.sampled_from(["prefill", "decode"]), after_commit=st.booleans(),
          restart_after=st.sampled_from([0.0, 1.0, 6.0]))
    def crash(self, role, after_commit, restart_after):
        self.world.crash(role, restart_after=restart_after, after_commit=after_commit)

    @rule(role=st.sampled_from(["prefill", "decode"]), seconds=st.sampled_from([4.0, 8.0]))
    def outage(self, role, seconds):
        """A request is sent, so that the peer watches the process; 20 ms later the process dies and stays down
        longer than its peer takes to declare it dead (three heartbeat intervals), then comes back as a new
        instance: what the peer forgot of it must not be used again."""
        self.request(40)
        self.world.run(until=self.world.clock.now() + 0.02)
        self.world.crash(role, restart_after=seconds)
        self.world.run(until=self.world.clock.now() + seconds)

    @rule(role=st.sampled_from(["prefill", "decode"]), seconds=st.sampled_from([0.5, 4.0]))
    def stall(self, role, seconds):
        """The process is stopped (SIGSTOP) for a while, then carries on: short enough that no heartbeat is
        missed twice, or long enough that its peer declares it dead meanwhile (the pings go unanswered)."""
        self.world.stall(role, seconds)

    @rule(role=st.sampled_from(["prefill", "decode"]))
    def replace_instance(self, role):
        """The process dies and a new instance comes up at once at the same address, before any heartbeat."""
        self.world.crash(role, restart_after=0.0)
        self.world.run(until=self.world.clock.now())

    @rule(dt=st.sampled_from([0.0005, 0.002, 0.01, 0.1, 1.0, 6.0]))
    def advance(self, dt):
        self.world.run(until=self.world.clock.now() + dt)

    # --- invariants, after every step ---
    @invariant()
    def ownership(self):
        assert ownership_violations(self.world) == []

    @invariant()
    def nothing_held_for_ended_rooms_once_quiet(self):
        if self.world.quiet():
            assert leaks(self.world) == []
            assert page_accounting(self.world)[:3] == []

    @invariant()
    def every_room_ends_within_its_deadlines(self):
        assert overdue_rooms(self.world) == []

    @invariant()
    def no_room_outlives_its_peer_nor_its_state_deadline(self):
        """Checked at every instant the world settled, not only now: no room stays bound to a dead peer longer
        than the heartbeats take to notice, and none stays in any state longer than that state's deadline plus
        the slack (``invariants.state_slack_s``)."""
        assert self.instant_violations[:3] == []

    @invariant()
    def both_sides_agree_and_no_corrupted_handoff_is_decoded(self):
        assert outcome_disagreements(self.world)[:3] == []
        assert corruption_served(self.world)[:3] == []

    @invariant()
    def live_state_is_the_replay_of_the_journals_and_the_tables_decision(self):
        rows = journal_rows(self.world)
        assert journal_disagreements(self.world, rows) == []
        assert table_disagreements(self.world, rows)[:3] == []  # an oracle: the literal tables, not fire

    @invariant()
    def states_are_table_states_and_terminals_stick(self):
        """A room is created once per node, so what ended stays ended: a reused room must be refused (it would
        otherwise start again, or fork its journal)."""
        assert self.world.reuse_accepted == []
        for (_node, role, room_id), room in self.world.live_rooms().items():
            assert room.state in STATE_NAMES
            key = (role, room_id)
            if key in self.terminal_seen:
                assert room.state == self.terminal_seen[key], f"{key} left {self.terminal_seen[key]}"
            elif room.state in TERMINAL:
                self.terminal_seen[key] = room.state

    def teardown(self):
        world = getattr(self, "world", None)
        if world is None:
            return
        try:
            world.heal()  # the fault phase is over: no faults, no partitions, every node up
            world.run()  # past every deadline (bounded: a room that never ends raises Stuck)
            self.everything_ended_and_was_freed()
            self.new_requests_succeed()
            world.run()
            self.everything_ended_and_was_freed()
        finally:
            world.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def everything_ended_and_was_freed(self):
        world = self.world
        unfinished = [key for key, room in world.live_rooms().items() if not room.terminal]
        assert unfinished == [], f"rooms left unfinished: {unfinished}"
        assert world.quiet()
        assert leaks(world) == []
        assert page_accounting(world)[:3] == []
        self.ownership()
        self.every_room_ends_within_its_deadlines()
        self.no_room_outlives_its_peer_nor_its_state_deadline()
        self.both_sides_agree_and_no_corrupted_handoff_is_decoded()
        assert corruption_served(world, journal_rows(world))[:3] == []  # and replay names the checksum
        self.live_state_is_the_replay_of_the_journals_and_the_tables_decision()
        self.states_are_table_states_and_terminals_stick()

    def new_requests_succeed(self):
        """Liveness: the cluster recovers. Once every process has been up for ``recovery_s`` (long enough for each
        side to have noticed every death and restart of the other), a burst of new requests all reach Success on
        both sides within ``handoff_bound_s`` (the shortest deadline)."""
        world = self.world
        world.run(until=world.clock.now() + recovery_s(world.config))
        at = world.clock.now() + 0.001
        rooms = list(range(self.next_room, self.next_room + len(LIVENESS_PROMPTS)))
        self.next_room += len(rooms)
        for room, prompt_len in zip(rooms, LIVENESS_PROMPTS, strict=True):
            world.add_request(room, prompt_len, at)
        world.run(until=at + handoff_bound_s(world.config))
        assert not_succeeded(world, rooms) == [], f"t={world.clock.now():.3f}, the requests were sent at t={at:.3f}"


class SharedPoolMachine(SimulationMachine):
    """``--role pd`` on one set of devices: both roles one process over one pool (64 pages and the prefill
    engine's 24 or 64), whose handoffs move page ownership through the production handlers and the allocator's
    ``hand_over`` (``fsm_pd/sim/shared_pool.py``). Every rule above runs (a crash or a stall is one of both roles),
    and one more: the prefill room ends while the decode side holds its page list. The allocator checks every
    hand-over as it happens (the pages come from the prefill room of the same id, hold its final KV, are the
    receiver's alone; what the receiver gave back is free), every free (a room frees only its own pages), and,
    once quiet, that every page is free, one room's or cached, by the real allocator's record and the simulation's.
    """

    @initialize(seed=st.integers(0, 2**16), background_faults=st.sampled_from([0.0, 0.05, 0.2]),
                prefill_pages=st.sampled_from([24, 64]))
    def start(self, seed, background_faults, prefill_pages):
        self.begin(SimConfig(requests=0, seed=seed, fault_rate=background_faults, num_pages=64, decode_tokens=256,
                             prefill_pages=prefill_pages, shared_pool=1.0))

    @rule(prompt_len=st.integers(1, 300), moment=st.sampled_from(["landed", "scattering"]), told=st.booleans(),
          others=st.lists(st.integers(1, 300), max_size=4))
    def prefill_leaves_during_the_handoff(self, prompt_len, moment, told, others):
        """A request runs until D has its page list but has not reported it (``landed``), or has reported it and
        its hand-over waits on the model thread (``scattering``); then the prefill room ends (its client leaves)
        and frees its pages, and ``others`` arrive to take them. Unless ``told``, the ABORT is lost and D goes on:
        its hand-over must refuse pages freed, and perhaps reserved again, meanwhile."""
        world, room = self.world, self.next_room
        self.request(prompt_len)

        def reached() -> bool:
            decode = world.decode.instance
            found = decode.node.rooms.get(room)
            if not world.decode.alive or (found is not None and found.terminal):
                return True  # it will never get there
            if moment == "scattering":
                return found is not None and "pulled" in found.seen
            return room in decode.effects.pending and any(h.room == room for h in world.ledger.holdings("pulled"))

        world.run_until(reached)
        if not told:
            world.plan.forced_messages.append("drop")
        world.abort("prefill", room, "client went away")
        self.burst(others)


PROFILE = os.environ.get("FSM_PD_PROPERTY_PROFILE", "ci")
_profile = dict(PROFILES[PROFILE])
if os.environ.get("FSM_PD_PROPERTY_EXAMPLES"):
    _profile["max_examples"] = int(os.environ["FSM_PD_PROPERTY_EXAMPLES"])
SimulationMachine.TestCase.settings = settings(
    **_profile, deadline=None, print_blob=True, report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
# A passing CI run takes about 20 s; a failing one also shrinks its example, which may take minutes: let it finish
# rather than cut it off without the example. The long profile is not bounded at all.
pytestmark = pytest.mark.timeout(900 if PROFILE == "ci" else 0)
TestSimulation = SimulationMachine.TestCase
# a quarter of the examples, 10 or more (the mode adds one rule and one path to the others): about 5 s of the CI run
SharedPoolMachine.TestCase.settings = settings(
    SimulationMachine.TestCase.settings,
    max_examples=max(10, _profile["max_examples"] // 4))
TestSharedPool = SharedPoolMachine.TestCase
