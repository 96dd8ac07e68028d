"""The node loop: write-ahead, effect failures as events, timers, recovery."""

from __future__ import annotations

import sqlite3

from fsm_pd.effects import EffectError, EffectInterpreter, Node, RecordingInterpreter, VirtualClock
from fsm_pd.machines import RECEIVER, SENDER
from fsm_pd.machines.effect_types import (
    FreePages,
    GatherAndPublish,
    ReleaseStaging,
    ReservePages,
    ResolveBootstrap,
    Send,
)
from fsm_pd.store import Journal, read_journal, replay

SENDER_DEADLINES = {"bootstrap": 5.0, "waiting": 5.0, "pull_hold": 5.0}
RECEIVER_DEADLINES = {"bootstrap": 5.0, "admission": 5.0, "waiting": 5.0, "transfer": 5.0}
LAYOUT = {"num_layers": 1, "num_pages": 4, "page_size": 2, "kv_heads": 1, "head_dim": 4}


def committed_rows(path) -> list[tuple]:
    """What another process would see in the journal right now."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT room, version, trigger FROM transitions ORDER BY seq").fetchall()
    finally:
        conn.close()


def test_effects_run_only_after_their_transition_is_committed(tmp_path):
    path = tmp_path / "p.db"
    seen_by_handler = []

    def gather(node, room, effect):
        seen_by_handler.append(committed_rows(path))

    interp = EffectInterpreter({GatherAndPublish: gather, Send: lambda *a: None, ReleaseStaging: lambda *a: None})
    node = Node("p", SENDER, Journal(path), interp, VirtualClock(), SENDER_DEADLINES)
    node.create(1, {"layout": LAYOUT})
    node.submit(1, "kv_ready")
    node.submit(1, "metadata_received", {"peer_layout": LAYOUT})
    assert node.step() == 3
    assert seen_by_handler == [[(1, 0, "create"), (1, 1, "kv_ready"), (1, 2, "metadata_received")]]


def test_a_node_whose_loop_commits_still_commits_a_failure_before_its_effects(tmp_path):
    """``commit_by_loop`` (``--role pd`` on one pool): a step's rows wait for the loop's commit, except where the
    step fails a room: its client hears of that at once, so the row is committed before the effects run."""
    path = tmp_path / "p.db"
    seen_by_handler = []
    interp = EffectInterpreter({Send: lambda *a: seen_by_handler.append(("send", committed_rows(path))),
                                ReleaseStaging: lambda *a: seen_by_handler.append(("release", committed_rows(path)))})
    node = Node("p", SENDER, Journal(path), interp, VirtualClock(), SENDER_DEADLINES, commit_by_loop=True)
    node.create(1, {"layout": LAYOUT})
    node.submit(1, "metadata_received", {"peer_layout": LAYOUT})
    node.step()
    assert node.rooms[1].state == "WaitingForInput"
    assert committed_rows(path) == [] and node.journal.pending == 2  # left for the loop
    node.submit(1, "error", {"blame": "local", "reason": "aborted"})
    node.step()
    assert node.rooms[1].state == "Failed"  # and its ABORT went to the peer only once all three rows were committed
    assert seen_by_handler == [("send", [(1, 0, "create"), (1, 1, "metadata_received"), (1, 2, "error")])]


def test_handler_failures_become_error_events_with_blame(tmp_path):
    def unreachable(node, room, effect):
        raise EffectError("bootstrap server unreachable", blame="remote")

    def buggy(node, room, effect):
        raise KeyError("page_count")

    freed = []
    interp = EffectInterpreter({ResolveBootstrap: unreachable, ReservePages: buggy,
                                FreePages: lambda n, r, e: freed.append(r.room)})
    node = Node("d", RECEIVER, Journal(tmp_path / "d.db"), interp, VirtualClock(), RECEIVER_DEADLINES)
    node.create(5, {"layout": LAYOUT})
    node.step()
    node.step()
    room = node.rooms[5]
    assert room.state == "Failed"
    assert room.reason == "remote error: bootstrap server unreachable"
    assert freed == [5]
    rows = read_journal(tmp_path / "d.db")
    errors = [r for r in rows if r.trigger == "error"]
    assert errors[0].event["blame"] == "remote"
    assert errors[1].event["blame"] == "local" and "KeyError" in errors[1].event["reason"]
    assert errors[1].payload["ignored"] == "room is already Failed"


def test_deadline_timer_fails_a_stuck_room_and_a_cancelled_one_is_harmless():
    clock = VirtualClock()
    node = Node("p", SENDER, None, EffectInterpreter({Send: lambda *a: None}), clock, SENDER_DEADLINES)
    node.create(1, {"layout": LAYOUT})
    node.create(2, {"layout": LAYOUT})
    node.step()
    clock.call_at(1.0, lambda: node.submit(2, "metadata_received", {"peer_layout": LAYOUT}))
    clock.fire_next()
    node.step()
    assert node.rooms[2].state == "WaitingForInput"
    clock.fire_next()  # t=5: room 1's bootstrap deadline; room 2's was cancelled
    node.step()
    assert clock.now() == 5.0
    assert node.rooms[1].state == "Failed" and node.rooms[1].reason == "bootstrap timeout"
    assert node.rooms[2].state == "WaitingForInput"
    clock.fire_next()  # t=6: room 2's waiting deadline
    node.step()
    assert node.rooms[2].reason == "waiting timeout"
    assert clock.next_time() is None


def test_recover_fails_unfinished_rooms_and_continues_their_versions(tmp_path):
    path = tmp_path / "p.db"
    sends = []
    interp = EffectInterpreter({GatherAndPublish: lambda *a: None, ReleaseStaging: lambda *a: None,
                                Send: lambda n, r, e: sends.append((r.room, e.kind))})
    node = Node("p", SENDER, Journal(path), interp, VirtualClock(), SENDER_DEADLINES)
    for room in (1, 2, 3):
        node.create(room, {"layout": LAYOUT})
    node.submit(2, "metadata_received", {"peer_layout": LAYOUT, "peer": "d"})
    node.submit(3, "abort", {"reason": "client went away"})
    node.step()
    node.journal.engine.dispose()  # the process dies here

    restarted = Node("p", SENDER, Journal(path), interp, VirtualClock(), SENDER_DEADLINES)
    assert restarted.recover() == [1, 2]
    restarted.step()
    assert {r: restarted.rooms[r].reason for r in (1, 2)} == {
        1: "local error: node restarted", 2: "local error: node restarted"}
    assert 3 not in restarted.rooms  # finished before the crash: not reloaded
    assert (2, "ABORT") in sends and (1, "ABORT") not in sends  # only a known peer is told
    result = replay(read_journal(path))
    assert result.consistent
    assert [e["version"] for e in result.rooms[1].events] == [0, 1, 2]


def test_events_for_cleared_rooms_are_dropped_and_counted():
    node = Node("p", SENDER, None, RecordingInterpreter(), VirtualClock(), SENDER_DEADLINES)
    node.create(1, {"layout": LAYOUT})
    node.submit(1, "abort")
    node.step()
    node.clear(1)
    node.submit(1, "pull_done")
    assert node.step() == 0 and node.dropped_unknown_room == 1


def test_a_clear_takes_its_turn_in_the_inbox():
    """``clear`` is queued like an event (rooms change only in ``step``): what came before it is decided, published
    and observed; what comes after finds no room; the room's published state goes last."""
    node = Node("p", SENDER, None, RecordingInterpreter(), VirtualClock(), SENDER_DEADLINES)
    seen = []
    node.observers.append(lambda room, decision, at: seen.append((room.room, decision.trigger, decision.dst)))
    node.create(1, {"layout": LAYOUT})
    node.step()
    node.submit(1, "abort", {"reason": "client left"})  # the same step decides it, then forgets the room
    node.clear(1)
    node.submit(1, "pull_done")
    assert node.step() == 1 and node.dropped_unknown_room == 1
    assert seen[-1] == (1, "abort", "Failed")
    assert 1 not in node.rooms and node.poll(1) is None and node.reasons == {}


def test_a_clear_of_a_live_room_is_refused_and_the_room_goes_on():
    node = Node("p", SENDER, None, RecordingInterpreter(), VirtualClock(), SENDER_DEADLINES)
    node.create(1, {"layout": LAYOUT})
    node.step()
    node.clear(1)  # a caller's bug: the room is still Bootstrapping
    node.step()
    assert node.rooms[1].state == "Bootstrapping" and node.poll(1) is not None
