"""Prefill and decode processes that find each other through the bootstrap server, and every way a room can end.

The prefill process serves its own bootstrap server (as ``fsm-pd serve --role prefill`` does) and registers with
it; the decode process resolves the prefill node from the request's bootstrap address, as SGLang's does. Each test
drives one deadline, abort or heartbeat failure and checks the journaled path, the reason, that the deadline was
met, and that pages and buffers are back at their baseline.
"""

from __future__ import annotations

import time

import pytest
from pd_harness import assert_replay_consistent, cluster, final, wait_for_state

from fsm_pd.cli.launch import free_port
from fsm_pd.store import read_journal

assert cluster  # a fixture, used by name
SLACK = 1.5  # seconds of scheduling noise allowed past a deadline on this 2-core machine


def pair(
    cluster,
    *,
    prefill_deadlines=None,
    decode_deadlines=None,
    pull_delay=0.0,
    bootstrap_port=0,
    heartbeat=None,
    backend="zmq",
):
    p = cluster("prefill", backend, deadlines=prefill_deadlines, bootstrap_port=bootstrap_port)
    d = cluster("decode", backend, deadlines=decode_deadlines, pull_delay=pull_delay, heartbeat=heartbeat)
    return p, d


def request(p, d, room, pages, *, kv_ready=True):
    p("add_sender", room=room, pages=pages)
    d("add_receiver", room=room, page_count=len(pages), bootstrap_addr=p.info["bootstrap"].split("://")[1])
    if kv_ready:
        p("kv_ready", room=room)


def path(journal, room):
    return [(r.trigger, r.dst) for r in read_journal(journal) if r.room == room and r.src != r.dst]


def baseline(p, d):
    pc, dc = p("counters"), d("counters")
    assert pc["staging_buffers_held"] == 0 and pc["open_transfer_entries"] == 0, pc
    assert dc["pages_reserved"] == 0 and dc["pulled_awaiting_scatter"] == 0 and dc["rooms_waiting_for_pages"] == 0


def elapsed_in(journal, room, state):
    """Seconds the room spent in ``state`` before leaving it."""
    rows = [r for r in read_journal(journal) if r.room == room]
    entered = next(r.at for r in rows if r.dst == state and r.src != state) if state != "Bootstrapping" else rows[0].at
    left = next(r.at for r in rows if r.src == state and r.dst != state)
    return left - entered


def test_found_through_the_bootstrap_server(cluster):
    p, d = pair(cluster)
    request(p, d, 1, [3, 4, 5])
    assert d("wait", room=1)["state"] == "Success" and p("wait", room=1)["state"] == "Success"
    steps = path(d.journal, 1)
    assert [dst for _, dst in steps] == ["WaitingForInput", "Transferring", "Success"]
    assert steps[0][0] in ("bootstrap_resolved", "pages_reserved")  # whichever of the two finished second
    resolved = next(r for r in read_journal(d.journal) if r.trigger == "bootstrap_resolved")
    assert resolved.event["prefill_addr"] == p.info["side_channel"] and resolved.event["peer"] == "prefill-0"
    d("finish", room=1)
    baseline(p, d)


def test_bootstrap_deadline_on_prefill(cluster):
    p, d = pair(cluster, prefill_deadlines={"bootstrap": 1.0})
    p("add_sender", room=1, pages=[2])  # the decode side never hears of this request
    assert p("wait", room=1, timeout=10) == {"state": "Failed", "reason": "bootstrap timeout"}
    assert elapsed_in(p.journal, 1, "Bootstrapping") <= 1.0 + SLACK
    baseline(p, d)


def test_waiting_deadline_on_decode(cluster):
    p, d = pair(cluster, decode_deadlines={"waiting": 1.0})
    request(p, d, 1, [2, 3], kv_ready=False)  # the prefill never finishes
    assert d("wait", room=1, timeout=10) == {"state": "Failed", "reason": "waiting timeout"}
    assert elapsed_in(d.journal, 1, "WaitingForInput") <= 1.0 + SLACK
    assert p("wait", room=1, timeout=10) == {"state": "Failed", "reason": "aborted by peer: waiting timeout"}
    baseline(p, d)


def test_transfer_deadline_on_decode(cluster):
    p, d = pair(cluster, decode_deadlines={"transfer": 1.0}, pull_delay=3.0)
    request(p, d, 1, [2, 3])
    assert d("wait", room=1, timeout=10) == {"state": "Failed", "reason": "transfer timeout"}
    assert elapsed_in(d.journal, 1, "Transferring") <= 1.0 + SLACK
    assert p("wait", room=1, timeout=10) == {"state": "Failed", "reason": "aborted by peer: transfer timeout"}
    # the delayed pull reports to a finished room: its result (the entry was failed meanwhile, so an error) is
    # journaled as ignored, and nothing is scattered
    late = late_results(d.journal, 1)
    assert late and all((r.src, r.payload.get("ignored")) == ("Failed", "room is already Failed") for r in late), late
    assert "scattered" not in {r.trigger for r in read_journal(d.journal) if r.room == 1}
    assert [t for t, _ in path(d.journal, 1)][-1] == "timeout"
    baseline(p, d)


def late_results(journal, room, timeout=30.0):
    """The rows of a pull's result (``pulled`` or ``error``) journaled after the room had failed, once one exists."""
    deadline = time.time() + timeout
    while True:
        rows = [r for r in read_journal(journal) if r.room == room and r.src == "Failed"
                and r.trigger in ("pulled", "error")]
        if rows or time.time() > deadline:
            return rows
        time.sleep(0.1)


def test_pull_hold_deadline_on_prefill(cluster):
    p, d = pair(cluster, prefill_deadlines={"pull_hold": 1.0}, pull_delay=3.0)
    request(p, d, 1, [2, 3])
    assert p("wait", room=1, timeout=10) == {"state": "Failed", "reason": "pull_hold timeout"}
    assert elapsed_in(p.journal, 1, "Transferring") <= 1.0 + SLACK
    assert d("wait", room=1, timeout=10) == {"state": "Failed", "reason": "aborted by peer: pull_hold timeout"}
    baseline(p, d)


@pytest.mark.parametrize("who", ["prefill", "decode"])
def test_abort_in_each_direction(cluster, who):
    p, d = pair(cluster)
    request(p, d, 1, [2, 3], kv_ready=False)
    wait_for_state(p, 1, "WaitingForInput")
    wait_for_state(d, 1, "WaitingForInput")
    (p if who == "prefill" else d)("abort", room=1, reason="client went away")
    origin, other = (p, d) if who == "prefill" else (d, p)
    assert origin("wait", room=1) == {"state": "Failed", "reason": "client went away"}
    assert other("wait", room=1) == {"state": "Failed", "reason": "aborted by peer: client went away"}
    assert path(other.journal, 1)[-1] == ("peer_abort", "Failed")
    baseline(p, d)
    p.stop(), d.stop()
    assert_replay_consistent(p.journal, d.journal)


def test_heartbeat_failure_fails_rooms_and_a_restarted_prefill_is_used_afresh(cluster):
    port = free_port()
    heartbeat = {"interval_s": 0.5, "max_failures": 2}
    p, d = pair(cluster, bootstrap_port=port, heartbeat=heartbeat)
    request(p, d, 1, [2, 3], kv_ready=False)
    wait_for_state(d, 1, "WaitingForInput")
    old_side_channel = p.info["side_channel"]
    p.kill()  # the prefill process and its bootstrap server die together
    killed_at = time.time()
    assert d("wait", room=1, timeout=10)["state"] == "Failed"
    assert d("state", room=1)["reason"] == (f"peer failed: prefill node at {old_side_channel} missed 2 heartbeats "
                                            "0.5 s apart: it died, hangs or is cut off")
    failed_at = [r.at for r in read_journal(d.journal) if r.room == 1 and r.dst == "Failed"][0]
    assert failed_at - killed_at <= 0.5 * 3 + SLACK
    assert d("counters")["pages_reserved"] == 0

    p.start()  # a new prefill process behind the same bootstrap address, with a new side channel
    assert p.info["side_channel"] != old_side_channel
    request(p, d, 2, [4])
    assert d("wait", room=2, timeout=20)["state"] == "Success"
    resolved = [r for r in read_journal(d.journal) if r.room == 2 and r.trigger == "bootstrap_resolved"][0]
    assert resolved.event["prefill_addr"] == p.info["side_channel"], "the stale lookup was dropped"
    assert final(p.journal, 1)[1] == "local error: node restarted"


def test_a_prefill_restarted_at_a_new_address_is_used_before_its_death_is_declared(cluster):
    """A prefill node that comes back faster than its death can be declared (here 30 missed heartbeats): the decode
    node's next lookup distrusts the cached node, which missed a heartbeat, asks the bootstrap server and finds the
    new process. The old one's room fails at once: by the new process's ABORT (it recovered the room from its
    journal) or by the moved registration, whichever comes first; both name the restart."""
    port = free_port()
    p, d = pair(cluster, bootstrap_port=port, heartbeat={"interval_s": 0.5, "max_failures": 30})
    request(p, d, 1, [2, 3], kv_ready=False)
    wait_for_state(d, 1, "WaitingForInput")
    # the prefill node has the decode node's PREPARE: else its send to the killed node fails the room as unreachable
    wait_for_state(p, 1, "WaitingForInput")
    old_side_channel = p.info["side_channel"]
    p.kill()
    killed_at = time.time()
    deadline = killed_at + 30
    while not d("suspect", addr=old_side_channel)["suspect"]:  # the decode node missed a heartbeat from it
        assert time.time() < deadline, "the dead prefill node never missed a heartbeat"
        time.sleep(0.05)
    p.start()
    assert p.info["side_channel"] != old_side_channel
    request(p, d, 2, [4])
    assert d("wait", room=2, timeout=20)["state"] == "Success"
    resolved = [r for r in read_journal(d.journal) if r.room == 2 and r.trigger == "bootstrap_resolved"][0]
    assert resolved.event["prefill_addr"] == p.info["side_channel"], "the cached, doubted lookup was not used"
    assert d("wait", room=1, timeout=5)["state"] == "Failed"
    reason = d("state", room=1)["reason"]
    assert reason == "aborted by peer: local error: node restarted" or reason.startswith(
        f"peer failed: prefill node at {old_side_channel} restarted: instance "), reason
    failed_at = [r.at for r in read_journal(d.journal) if r.room == 1 and r.dst == "Failed"][0]
    assert failed_at - killed_at < 0.5 * 30, "long before its death would have been declared"
    p.stop(), d.stop()
    assert_replay_consistent(p.journal, d.journal)
