"""Property tests: hypothesis drives requests and faults through the simulation and checks the invariants.

Rules are requests and faults (dropped messages, failed pulls and bootstrap lookups, aborts on either side, a prefill
crash) interleaved with the passage of virtual time. After every rule: every room is in a state of its table, and a
terminal room never changes. At teardown the clock runs past every deadline and then: every room on both sides is
terminal, every staging buffer was released exactly once, every reserved page was freed exactly once, and replaying
the SQLite journals gives exactly the live states.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fsm_pd.machines.states import STATE_NAMES, TERMINAL
from fsm_pd.sim import SimConfig, World
from fsm_pd.store import read_journal, replay


class SimulationMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**16), background_faults=st.sampled_from([0.0, 0.0, 0.1, 0.3]))
    def start(self, seed, background_faults):
        self.dir = Path(tempfile.mkdtemp(prefix="fsm-pd-prop-"))
        config = SimConfig(requests=0, seed=seed, fault_rate=background_faults, num_pages=64)
        self.world = World(config, self.dir, durability="off")
        self.next_room = 1
        self.terminal_seen: dict[tuple[str, int], str] = {}

    @rule(prompt_len=st.integers(1, 300))
    def request(self, prompt_len):
        self.world.add_request(self.next_room, prompt_len, at=self.world.clock.now() + 0.001)
        self.next_room += 1

    @rule()
    def drop_next_message(self):
        self.world.faults.drop_next += 1

    @rule()
    def fail_next_pull(self):
        self.world.faults.fail_next_pull += 1

    @rule()
    def fail_next_bootstrap_lookup(self):
        self.world.faults.fail_next_resolve += 1

    @precondition(lambda self: self.next_room > 1)
    @rule(side=st.sampled_from(["prefill", "decode"]), data=st.data())
    def abort(self, side, data):
        room = data.draw(st.integers(1, self.next_room - 1))
        self.world.abort(side, room, "client went away")

    @rule()
    def crash_prefill(self):
        self.world.crash_prefill()

    @rule(dt=st.sampled_from([0.0005, 0.002, 0.01, 0.1, 1.0, 6.0]))
    def advance(self, dt):
        self.world.run(until=self.world.clock.now() + dt)

    def _nodes(self):
        return (self.world.prefill, self.world.decode)

    @invariant()
    def states_are_table_states_and_terminals_stick(self):
        for node in self._nodes():
            for room in node.rooms.values():
                assert room.state in STATE_NAMES
                key = (node.role, room.room)
                if key in self.terminal_seen:
                    assert room.state == self.terminal_seen[key], f"{key} left {self.terminal_seen[key]}"
                elif room.state in TERMINAL:
                    self.terminal_seen[key] = room.state

    @invariant()
    def failed_rooms_hold_nothing(self):
        assert self.world.staging.violations == []
        for room in self.world.decode.rooms.values():
            if room.state == "Failed":
                assert self.world.pages.pages_of(room.room) == []
        for room in self.world.prefill.rooms.values():
            if room.terminal:
                assert room.room not in self.world.staging.held

    def teardown(self):
        world = getattr(self, "world", None)
        if world is None:
            return
        try:
            world.run()  # past every deadline
            self.states_are_table_states_and_terminals_stick()
            for node in self._nodes():
                unfinished = [r.room for r in node.rooms.values() if not r.terminal]
                assert unfinished == [], f"{node.role} rooms left unfinished: {unfinished}"
            staging = world.staging
            assert staging.held == {} and staging.violations == []
            assert all(staging.releases.get(room) == 1 for room in staging.allocations), staging.releases
            assert world.pages.reserved_pages == 0
            assert all(len(causes) == 1 for causes in world.page_releases.values()), world.page_releases
            for node in self._nodes():
                node.journal.flush()
            rows = read_journal(self.dir / "prefill.db") + read_journal(self.dir / "decode.db")
            result = replay(rows)
            assert result.consistent, [d.describe() for d in result.divergences]
            live = {key: room.state for key, room in world.live_rooms().items()}
            assert result.final_states() == live
        finally:
            world.close()
            shutil.rmtree(self.dir, ignore_errors=True)


SimulationMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSimulation = SimulationMachine.TestCase
