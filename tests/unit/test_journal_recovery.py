"""Recovery from the journal's snapshot of open rooms gives exactly what recovery from every row gave.

Random histories (rooms of two nodes and both roles in one file, random events and batch boundaries) are written by
the production node loop and journal; then a restarted node recovers once through the ``rooms`` table and once by
reading the whole journal (``Node.restore`` of every row, the way recovery worked before the table).
"""

from __future__ import annotations

import sqlite3

from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import event

from fsm_pd.effects import Node, RecordingInterpreter, VirtualClock
from fsm_pd.machines import RECEIVER, SENDER
from fsm_pd.store import Journal, read_journal

LAYOUT = {"num_layers": 1, "num_pages": 4, "page_size": 2, "kv_heads": 1, "head_dim": 4}
DEADLINES = {"prefill": {"bootstrap": 5.0, "waiting": 5.0, "pull_hold": 5.0},
             "decode": {"bootstrap": 5.0, "admission": 5.0, "waiting": 5.0, "transfer": 5.0}}
MACHINES = {"prefill": SENDER, "decode": RECEIVER}
# payloads that let the happy path move (a matching layout, pages, a peer) and failures that end a room
PAYLOADS = {
    "metadata_received": {"peer_layout": LAYOUT, "peer": "d"}, "kv_published": {"peer_layout": LAYOUT, "uuid": 1},
    "pages_reserved": {"pages": [0, 1]}, "bootstrap_resolved": {"peer": "p"}, "abort": {"reason": "client went away"},
    "error": {"blame": "remote", "reason": "pull failed"}, "peer_abort": {"reason": "peer gave up"},
}
TIMERS = ("bootstrap", "waiting", "pull_hold", "transfer")

NODES = [("p0", "prefill"), ("d0", "decode"), ("p1", "prefill")]


def _event(role: str, draw) -> tuple[str, dict]:
    trigger = draw(st.sampled_from(sorted(set(MACHINES[role].triggers) - {"create"})))
    if trigger == "timeout":
        return trigger, {"timer": draw(st.sampled_from(TIMERS))}
    return trigger, dict(PAYLOADS.get(trigger, {}))


@st.composite
def histories(draw):
    """Per node: a list of steps, each a list of (room, trigger, payload) queued before one ``step()``."""
    out = {}
    for node, role in NODES:
        rooms = draw(st.lists(st.integers(0, 12), min_size=1, max_size=8, unique=True))
        steps, created = [], set()
        for _ in range(draw(st.integers(1, 6))):
            batch = []
            for _ in range(draw(st.integers(1, 8))):
                room = draw(st.sampled_from(rooms))
                if room not in created:
                    created.add(room)
                    batch.append((room, "create", {"layout": LAYOUT, "rid": f"r{room}"}))
                else:
                    batch.append((room, *_event(role, draw)))
            steps.append(batch)
        out[(node, role)] = steps
    return out


def _node(path, node_id: str, role: str) -> Node:
    return Node(node_id, MACHINES[role], Journal(path), RecordingInterpreter(), VirtualClock(), DEADLINES[role])


def write(path, history) -> None:
    for (node_id, role), steps in history.items():
        node = _node(path, node_id, role)
        for batch in steps:
            for room, trigger, payload in batch:
                if trigger == "create":
                    node.create(room, payload)
                else:
                    node.submit(room, trigger, payload)
            node.step()
        node.journal.engine.dispose()  # the process dies here, open rooms and all


def every_row(node) -> list:
    """The node's rows of the whole journal: recovery as it was before the ``rooms`` table, the oracle."""
    return [row for row in read_journal(node.journal.url) if row.node == node.node_id and row.role == node.role]


def recovered(path, node_id: str, role: str, full_scan: bool):
    node = _node(path, node_id, role)
    ids = node.restore(every_row(node)) if full_scan else node.recover()
    rooms = {room_id: (r.state, r.version, r.seen, r.armed, r.ctx, r.reason) for room_id, r in node.rooms.items()}
    out = (ids, rooms, dict(node.states), list(node._inbox))  # Room compares by identity: compare its fields
    node.journal.engine.dispose()
    return out


@settings(max_examples=40, deadline=None)
@given(history=histories())
def test_snapshot_recovery_equals_full_recovery(tmp_path_factory, history):
    path = tmp_path_factory.mktemp("j") / "shared.db"
    write(path, history)
    for node_id, role in NODES:
        snapshot = recovered(path, node_id, role, full_scan=False)
        assert snapshot == recovered(path, node_id, role, full_scan=True)


def test_recovery_reads_only_open_rooms(tmp_path):
    """One open room among many finished ones: recovery reads that room's rows and no other."""
    path = tmp_path / "p.db"
    node = _node(path, "p0", "prefill")
    for room in range(200):
        node.create(room, {"layout": LAYOUT})
        if room != 150:
            node.submit(room, "abort", {"reason": "client went away"})
    node.step()
    node.journal.engine.dispose()
    restarted = _node(path, "p0", "prefill")
    statements = []
    event.listen(restarted.journal.engine, "before_cursor_execute",
                 lambda conn, cursor, statement, *a: statements.append(statement))
    assert restarted.recover() == [150]
    reads = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    conn = sqlite3.connect(path)
    plans = [" ".join(str(step) for step in conn.execute("EXPLAIN QUERY PLAN " + s, _params(s)))
             for s in reads]
    conn.close()
    assert plans and all("SCAN" not in p for p in plans), plans  # index searches only, no table scan


def _params(statement: str) -> tuple:
    """Placeholder values for EXPLAIN QUERY PLAN: the plan does not depend on them."""
    return (0,) * statement.count("?")
