"""``fsm-pd replay --request RID``: the node core journals the client's request id with each room, and replay chains
every room of one request, on any node, into attempts on one timeline."""

from __future__ import annotations

import json
import sqlite3

from fsm_pd.cli.main import EXIT_OK, EXIT_UNREADABLE, main
from fsm_pd.control.core import NodeCore
from fsm_pd.effects import Node, RecordingInterpreter, VirtualClock
from fsm_pd.machines import RECEIVER, SENDER
from fsm_pd.store import Journal

LAYOUT = {"num_layers": 1, "num_pages": 4, "page_size": 2, "kv_heads": 1, "head_dim": 4}
DEADLINES = {"prefill": {"bootstrap": 5.0, "waiting": 5.0, "pull_hold": 5.0},
             "decode": {"bootstrap": 5.0, "admission": 5.0, "waiting": 5.0, "transfer": 5.0}}

PREFILL_OK = [("metadata_received", {"peer_layout": LAYOUT, "peer": "d"}), ("kv_ready", {}),
              ("published", {"uuid": 1}), ("pull_done", {"peer": "d"})]
DECODE_OK = [("pages_reserved", {"pages": [0, 1]}), ("bootstrap_resolved", {"peer": "p"}),
             ("kv_published", {"peer_layout": LAYOUT, "uuid": 1}), ("pulled", {}), ("scattered", {})]
PREFILL_ABORTED = [("metadata_received", {"peer_layout": LAYOUT, "peer": "d"}),
                   ("peer_abort", {"reason": "remote error: pull failed: connection reset"})]
DECODE_PULL_FAILED = [("pages_reserved", {"pages": [0, 1]}), ("bootstrap_resolved", {"peer": "p"}),
                      ("error", {"blame": "remote", "reason": "pull failed: connection reset"})]


def core(path, node_id: str, role: str, clock: VirtualClock) -> NodeCore:
    machine = SENDER if role == "prefill" else RECEIVER
    node = Node(node_id, machine, Journal(path), RecordingInterpreter(), clock, DEADLINES[role])
    return NodeCore(node, LAYOUT)


def run(c: NodeCore, room: int, rid: str | None, events, clock: VirtualClock) -> None:
    """Create the room the way the engines do (rid included), then feed it ``events`` a second apart."""
    if c.role == "prefill":
        c.add_sender(room, prompt_len=4, rid=rid)
    else:
        c.add_receiver(room, page_count=2, prompt_len=4, rid=rid, bootstrap_addr="127.0.0.1:1")
    c.node.step()
    for trigger, payload in events:
        clock.advance_to(clock.now() + 1.0)
        c.submit(room, trigger, payload)
        c.node.step()


def two_attempts(tmp_path):
    """Request req-7: room 11 on prefill-0 + decode-0 fails (the pull broke); room 12 on prefill-1 + decode-0
    succeeds. Another request shares the files."""
    clock = VirtualClock(1000.0)
    p0, p1, d0 = (core(tmp_path / f"{n}.db", n, n.split("-")[0], clock) for n in ("prefill-0", "prefill-1",
                                                                                    "decode-0"))
    run(d0, 11, "req-7", DECODE_PULL_FAILED, clock)  # the decode side fails first, then tells the prefill side
    run(p0, 11, "req-7", PREFILL_ABORTED, clock)
    run(p0, 30, "req-other", PREFILL_OK, clock)
    clock.advance_to(clock.now() + 2.0)
    run(p1, 12, "req-7", PREFILL_OK, clock)
    run(d0, 12, "req-7", DECODE_OK, clock)
    for c in (p0, p1, d0):
        c.node.journal.close()
    return [str(tmp_path / f"{n}.db") for n in ("prefill-0", "prefill-1", "decode-0")]


def test_the_node_core_journals_the_rid_in_the_rooms_first_row(tmp_path):
    clock = VirtualClock()
    c = core(tmp_path / "p.db", "prefill-0", "prefill", clock)
    run(c, 5, "req-5", [], clock)
    run(c, 6, None, [], clock)  # a client that sent no rid: the room is journaled without one
    c.node.journal.close()
    conn = sqlite3.connect(tmp_path / "p.db")
    first = conn.execute("SELECT payload FROM transitions WHERE room=5 AND version=0").fetchone()[0]
    indexed = conn.execute("SELECT room, rid FROM rooms ORDER BY room").fetchall()
    conn.close()
    assert json.loads(first)["event"]["rid"] == "req-5"
    assert indexed == [(5, "req-5"), (6, None)]


def test_replay_request_chains_attempts_across_nodes(tmp_path, capsys):
    journals = two_attempts(tmp_path)
    assert main(["replay", "--request", "req-7", *journals, "--format", "json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    attempts = doc["attempts"]
    assert [(a["room"], a["outcome"], a["next_room"]) for a in attempts] == [(11, "Failed", 12), (12, "Success", None)]
    assert [(s["role"], s["node"]) for s in attempts[0]["sides"]] == [("decode", "decode-0"), ("prefill", "prefill-0")]
    assert [(s["role"], s["node"]) for s in attempts[1]["sides"]] == [("decode", "decode-0"), ("prefill", "prefill-1")]
    assert attempts[0]["failed_first"] == {"role": "decode", "node": "decode-0", "ended_by": "error",
                                           "reason": "remote error: pull failed: connection reset"}
    # state by state with durations: the failed decode side spent 1 s bootstrapping, 1 s waiting
    decode = attempts[0]["sides"][0]
    assert decode["time_in_state"] == {"Bootstrapping": 2.0, "WaitingForInput": 1.0}
    assert all(s["room"] != 30 for a in attempts for s in a["sides"])  # the other request is not shown


def test_replay_request_table_tells_what_came_next(tmp_path, capsys):
    journals = two_attempts(tmp_path)
    assert main(["replay", "--request", "req-7", *journals]) == EXIT_OK
    out = capsys.readouterr()
    assert "reading " + ", ".join(journals) in out.err  # which files it read
    text = " ".join(out.out.split())
    assert ("attempt 1 (room 11 on decode decode-0, prefill prefill-0) failed after 5.00s: decode decode-0 ended it "
            "on error: remote error: pull failed: connection reset; next: attempt 2 began 6.00s after it ended, "
            "room 12 on decode decode-0, prefill prefill-1") in text
    assert "attempt 2 (room 12 on decode decode-0, prefill prefill-1) succeeded" in text


def test_replay_request_that_is_nowhere_exits_2(tmp_path, capsys):
    journals = two_attempts(tmp_path)
    assert main(["replay", "--request", "req-missing", *journals]) == EXIT_UNREADABLE
    assert "request req-missing is in none of" in capsys.readouterr().err
