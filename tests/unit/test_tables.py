"""The sender and receiver tables: every trigger in every state, stickiness, and agreement with `transitions`."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from fsm_pd.machines import RECEIVER, SENDER, KVPoll, Room, TransferMachine
from fsm_pd.machines.effect_types import (
    ArmTimer,
    CancelTimer,
    FreePages,
    GatherAndPublish,
    ReleaseStaging,
    Scatter,
    Send,
)
from fsm_pd.machines.graph import TableError, validate
from fsm_pd.machines.receiver import DEADLINES as RECEIVER_DEADLINES
from fsm_pd.machines.receiver import HANDOVERS as RECEIVER_HANDOVERS
from fsm_pd.machines.receiver import RECEIVER_TRANSITIONS
from fsm_pd.machines.sender import DEADLINES as SENDER_DEADLINES
from fsm_pd.machines.sender import SENDER_TRANSITIONS
from fsm_pd.machines.states import STATE_NAMES, TERMINAL

LAYOUT = {"num_layers": 2, "num_pages": 10, "page_size": 4, "kv_heads": 1, "head_dim": 8, "dtype": "float32",
          "shard_axis": None}
OTHER = {**LAYOUT, "head_dim": 16}


def room_in(machine: TransferMachine, state: str, **facts) -> Room:
    """A room driven into ``state`` through the table (not by assignment), with optional extra facts."""
    room = Room(1)
    machine.fire(room, "create", {"layout": LAYOUT})
    paths = {
        ("prefill", "WaitingForInput"): [("metadata_received", {"peer_layout": LAYOUT})],
        ("prefill", "Transferring"): [("metadata_received", {"peer_layout": LAYOUT}), ("kv_ready", {})],
        ("prefill", "Success"): [("metadata_received", {"peer_layout": LAYOUT}), ("kv_ready", {}),
                                 ("published", {}), ("pull_done", {})],
        ("prefill", "Failed"): [("abort", {})],
        ("decode", "WaitingForInput"): [("bootstrap_resolved", {}), ("pages_reserved", {})],
        ("decode", "Transferring"): [("bootstrap_resolved", {}), ("pages_reserved", {}),
                                     ("kv_published", {"peer_layout": LAYOUT})],
        ("decode", "Success"): [("bootstrap_resolved", {}), ("pages_reserved", {}),
                                ("kv_published", {"peer_layout": LAYOUT}), ("pulled", {}), ("scattered", {})],
        ("decode", "Failed"): [("abort", {})],
    }
    for trigger, payload in paths.get((machine.role, state), []):
        machine.fire(room, trigger, payload)
    for trigger, payload in facts.items():
        machine.fire(room, trigger, payload)
    assert room.state == state
    return room


# The legal moves (trigger from state -> dest) with default guards, written out independently of the tables.
SENDER_EXPECTED = {
    ("Bootstrapping", "kv_ready"): "Bootstrapping",
    ("Bootstrapping", "metadata_received"): "WaitingForInput",
    ("WaitingForInput", "kv_ready"): "Transferring",
    ("Transferring", "published"): "Transferring",
    ("Transferring", "kv_chunk"): "Transferring",  # a later prefill chunk: more pieces of the prompt go out
    **{(s, t): "Failed" for s in ("Bootstrapping", "WaitingForInput", "Transferring")
       for t in ("abort", "peer_abort", "error")},
    # the decode node is known (bound) only once its PREPARE arrived
    ("WaitingForInput", "peer_failed"): "Failed",
    ("Transferring", "peer_failed"): "Failed",
}
RECEIVER_EXPECTED = {
    ("Bootstrapping", "bootstrap_resolved"): "Bootstrapping",
    ("Bootstrapping", "pages_reserved"): "Bootstrapping",
    ("WaitingForInput", "kv_published"): "Transferring",
    ("Transferring", "pulled"): "Transferring",
    ("Transferring", "piece_pulled"): "Transferring",  # a piece of a chunked handoff landed: progress
    **{(s, t): "Failed" for s in ("Bootstrapping", "WaitingForInput", "Transferring")
       for t in ("abort", "peer_abort", "peer_failed", "error")},
}
PAYLOADS = {"metadata_received": {"peer_layout": LAYOUT}, "kv_published": {"peer_layout": LAYOUT}}


@pytest.mark.parametrize("machine,expected", [(SENDER, SENDER_EXPECTED), (RECEIVER, RECEIVER_EXPECTED)],
                         ids=["sender", "receiver"])
def test_every_trigger_in_every_state(machine, expected):
    for state, trigger in itertools.product(STATE_NAMES, (*machine.triggers, "nonsense")):
        room = room_in(machine, state)
        before = (room.state, set(room.armed), room.version)
        decision = machine.fire(room, trigger, PAYLOADS.get(trigger, {}))
        want = expected.get((state, trigger))
        assert decision.version == before[2], "every event, accepted or not, takes the next version"
        if want is None:
            assert decision.ignored, f"{trigger} from {state} should be ignored"
            assert room.state == state and decision.effects == () and room.armed == before[1]
        else:
            assert decision.ignored is None and decision.dst == want == room.state, (state, trigger)


@pytest.mark.parametrize("machine", [SENDER, RECEIVER], ids=["sender", "receiver"])
@pytest.mark.parametrize("terminal", sorted(TERMINAL))
def test_terminal_states_are_sticky(machine, terminal):
    room = room_in(machine, terminal)
    for trigger in (*machine.triggers, "create"):
        decision = machine.fire(room, trigger, {"timer": "bootstrap", "peer_layout": LAYOUT})
        assert room.state == terminal and decision.ignored and decision.effects == ()


def test_sender_prefill_before_prepare_goes_straight_to_transferring():
    room = room_in(SENDER, "Bootstrapping", kv_ready={})
    decision = SENDER.fire(room, "metadata_received", {"peer_layout": LAYOUT})
    assert decision.dst == "Transferring"
    assert GatherAndPublish() in decision.effects and ArmTimer("pull_hold") in decision.effects


def test_pull_done_requires_a_published_buffer():
    room = room_in(SENDER, "Transferring")
    assert SENDER.fire(room, "pull_done", {}).ignored  # PULLED before we ever sent READY is not believed
    SENDER.fire(room, "published", {})
    assert SENDER.fire(room, "pull_done", {}).dst == "Success"


@pytest.mark.parametrize("machine,trigger,state", [(SENDER, "metadata_received", "Bootstrapping"),
                                                   (RECEIVER, "kv_published", "WaitingForInput")])
def test_layout_mismatch_fails_before_any_transfer(machine, trigger, state):
    room = room_in(machine, state)
    decision = machine.fire(room, trigger, {"peer_layout": OTHER})
    assert decision.dst == "Failed" and decision.reason == "layout mismatch"
    assert Send("ABORT") in decision.effects
    assert not any(isinstance(e, (GatherAndPublish, Scatter)) for e in decision.effects)


def test_timeout_counts_only_for_the_armed_timer():
    room = room_in(SENDER, "WaitingForInput")
    assert room.armed == {"waiting"}
    assert SENDER.fire(room, "timeout", {"timer": "bootstrap"}).ignored  # cancelled on the way out of Bootstrapping
    decision = SENDER.fire(room, "timeout", {"timer": "waiting"})
    assert decision.dst == "Failed" and decision.reason == "waiting timeout" and room.armed == set()


def test_staging_released_on_exactly_the_exits_from_transferring():
    for row in SENDER_TRANSITIONS:
        releases = ReleaseStaging() in row["effects"]
        leaves_transferring = row["source"] == "Transferring" and row["dest"] != "Transferring"
        assert releases == leaves_transferring, row


def test_pages_freed_on_every_receiver_failure_and_kept_on_success():
    for row in RECEIVER_TRANSITIONS:
        assert (FreePages() in row["effects"]) == (row["dest"] == "Failed"), row


def test_scatter_only_after_a_verified_pull():
    scatter_rows = [r for r in RECEIVER_TRANSITIONS if Scatter() in r["effects"]]
    assert [r["trigger"] for r in scatter_rows] == ["pulled"]


def test_superset_of_sglang_jax_legal_transitions():
    # sglang-jax's kv_manager.py LEGAL_TRANSITIONS: three forward edges and three edges to Failed.
    legal = {("Bootstrapping", "WaitingForInput"), ("WaitingForInput", "Transferring"), ("Transferring", "Success"),
             ("Bootstrapping", "Failed"), ("WaitingForInput", "Failed"), ("Transferring", "Failed")}
    for table in (SENDER_TRANSITIONS, RECEIVER_TRANSITIONS):
        edges = {(r["source"], r["dest"]) for r in table}
        assert legal <= edges


def test_kvpoll_integers_match_sglang():
    assert [(s.name, int(s)) for s in KVPoll] == [("Failed", 0), ("Bootstrapping", 1), ("WaitingForInput", 2),
                                                  ("Transferring", 3), ("Success", 4)]


class LibraryModel:
    """A model of the library's own: its guards read the room as ``fsm_room`` (``machine._LibraryGuard``)."""

    def __init__(self, room):
        self.fsm_room = room


def trigger_through_library(machine, room, trigger: str, payload: dict) -> str:
    """One event through ``transitions``' own ``trigger()``; the new state. Only the state moves."""
    model = LibraryModel(room)
    machine.library.add_model(model, initial=room.state)
    try:
        if trigger in machine.triggers:
            machine.library.events[trigger].trigger(model, payload=payload)
        return model.state
    finally:
        machine.library.remove_model(model)


@pytest.mark.parametrize("machine", [SENDER, RECEIVER], ids=["sender", "receiver"])
def test_fire_agrees_with_the_transitions_library(machine):
    """For every reachable state, trigger and guard outcome, fire() and the library's trigger() pick the same dest."""
    fact_sets = ([{}, {"kv_ready": {}}] if machine is SENDER
                 else [{}, {"bootstrap_resolved": {}}, {"pages_reserved": {}}])
    payloads = [{}, {"peer_layout": LAYOUT}, {"peer_layout": OTHER}, {"timer": "bootstrap"}, {"timer": "waiting"},
                {"timer": "transfer"}, {"timer": "pull_hold"}, {"timer": "admission"}]
    checked = 0
    for state in STATE_NAMES:
        for facts in fact_sets if state == "Bootstrapping" else [{}]:
            for trigger in machine.triggers:
                for payload in payloads:
                    library_room = room_in(machine, state, **facts)
                    fire_room = room_in(machine, state, **facts)
                    via_library = trigger_through_library(machine, library_room, trigger, payload)
                    machine.fire(fire_room, trigger, payload)
                    assert via_library == fire_room.state, (state, facts, trigger, payload)
                    checked += 1
    assert checked > 100
    assert machine.library.get_transitions(trigger="timeout")  # the Machine really holds the table
    assert not hasattr(machine.library, "to_Failed")  # auto_transitions=False


def test_graph_check_rejects_broken_tables():
    good = list(SENDER_TRANSITIONS)
    validate(good, SENDER_DEADLINES)
    broken = {
        "exit from a terminal": good + [{"trigger": "x", "source": "Success", "dest": "Failed",
                                         "effects": ()}],
        "unreachable": [r for r in good if r["dest"] != "WaitingForInput"],
        "no deadline exit": [r for r in good if not (r["trigger"] == "timeout" and r["source"] == "Transferring")],
        "forgot to arm": [
            {**r, "effects": tuple(e for e in r["effects"] if e != ArmTimer("pull_hold"))} for r in good
        ],
        "unknown guard": good + [{"trigger": "x", "source": "Bootstrapping", "dest": "Failed",
                                  "conditions": ["no_such_guard"], "effects": ()}],
        "not a KVPoll state": good + [{"trigger": "x", "source": "Bootstrapping", "dest": "Limbo", "effects": ()}],
    }
    for name, table in broken.items():
        with pytest.raises(TableError):
            validate(table, SENDER_DEADLINES)
            pytest.fail(f"accepted a table with: {name}")
    validate(list(RECEIVER_TRANSITIONS), RECEIVER_DEADLINES, RECEIVER_HANDOVERS)
    with pytest.raises(TableError, match="cannot reach Failed|no timeout exit"):
        validate([r for r in RECEIVER_TRANSITIONS if not (r["source"] == "Transferring" and r["dest"] == "Failed")],
                 RECEIVER_DEADLINES, RECEIVER_HANDOVERS)


def test_graph_check_holds_a_handed_over_deadline_to_the_same_rules():
    """Bootstrapping hands ``bootstrap`` over to ``admission`` once the address is known: without the hand-over
    declared, with an exit that cancels the other timer, a row that does not say which one runs, or no timeout
    under admission, the table is refused."""
    good = list(RECEIVER_TRANSITIONS)
    resolved_abort = next(i for i, r in enumerate(good) if r["trigger"] == "abort" and r["source"] == "Bootstrapping"
                          and r.get("conditions") == ["bootstrap_resolved_seen"])
    broken = {
        "not declared": (good, {}),
        "an exit cancels the timer that is not armed": (
            [{**r, "effects": (CancelTimer("bootstrap"), *r["effects"][1:])} if i == resolved_abort else r
             for i, r in enumerate(good)], RECEIVER_HANDOVERS),
        "a row that does not say": (
            [{k: v for k, v in r.items() if k != "conditions"} if i == resolved_abort else r
             for i, r in enumerate(good)], RECEIVER_HANDOVERS),
        "no timeout under admission": (
            [r for r in good if not (r["trigger"] == "timeout" and r["source"] == "Bootstrapping"
                                     and "bootstrap_resolved_seen" in r.get("conditions", ()))], RECEIVER_HANDOVERS),
        "a hand-over that re-arms on a repeat": (
            [{k: v for k, v in r.items() if k != "unless"} if r["trigger"] == "bootstrap_resolved"
             and r["dest"] == "Bootstrapping" else r for r in good], RECEIVER_HANDOVERS),
    }
    for name, (table, handovers) in broken.items():
        with pytest.raises(TableError):
            validate(table, RECEIVER_DEADLINES, handovers)
            pytest.fail(f"accepted a table with: {name}")


@pytest.mark.parametrize("machine", [SENDER, RECEIVER], ids=["sender", "receiver"])
def test_every_reachable_room_has_exactly_one_deadline_armed_until_it_ends(machine):
    """Every sequence of up to five events (each trigger, with payloads that pass and fail each guard) from create:
    a room that has not ended has exactly one timer armed, one of its state's (entered or handed over to), and an
    ended one none. What the graph check proves of the rows, checked on the rooms they make."""
    payloads = [{}, {"peer_layout": LAYOUT}, {"peer_layout": OTHER},
                *({"timer": t} for t in sorted({*machine.timer_states, "none"}))]
    events = [(t, p) for t in machine.triggers if t != "create" for p in payloads]
    frontier, checked = [room_in(machine, "Bootstrapping")], 0
    for _ in range(5):
        following = {}
        for room in frontier:
            for trigger, payload in events:
                nxt = Room(room.room, room.state, room.version, set(room.seen), set(room.armed), dict(room.ctx))
                machine.fire(nxt, trigger, payload)
                checked += 1
                if nxt.terminal:
                    assert nxt.armed == set(), (trigger, nxt)
                    continue
                assert len(nxt.armed) == 1 and machine.timer_states[next(iter(nxt.armed))] == nxt.state, nxt
                following[(nxt.state, frozenset(nxt.seen), frozenset(nxt.armed))] = nxt
        frontier = list(following.values())
    assert checked > 1000


FORBIDDEN = {"zmq", "jax", "sqlalchemy", "fastapi", "time", "random", "socket", "threading", "asyncio", "uuid"}


def test_machines_package_does_no_io():
    package = Path(__file__).resolve().parents[2] / "fsm_pd" / "machines"
    offenders = []
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders
    assert len(list(package.glob("*.py"))) >= 7
