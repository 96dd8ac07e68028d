"""Two real processes on 127.0.0.1 hand a KV cache across, for each backend, and every fault ends cleanly.

Each test starts a prefill and a decode process (``pd_node.py``: a KVManager driven over stdin), creates rooms,
injects a fault (SIGKILL, an abort, a layout mismatch, forged messages), and then checks what the journals say, that
the failure came within its deadline, that every page and buffer is back, and that ``fsm-pd replay`` agrees.
"""

from __future__ import annotations

import signal
import time

import pytest
import zmq
from pd_harness import BACKENDS, LARGE, assert_replay_consistent, cluster, final, transfer, wait_for_state
from polling import until
from xla_flags import with_host_devices

from fsm_pd.kernels import KVLayout
from fsm_pd.store import read_journal
from fsm_pd.transport import Abort, Pulled
from fsm_pd.transport.signing import seal

assert cluster  # a fixture, used by name

# Heartbeats 15 s from declaring a killed peer dead, for the kill tests below that check another path (a pull's error,
# a deadline): with the default 2 beats 1 s apart the heartbeat raced those paths and, on a loaded CI run, named
# the room's end ("peer failed: ... missed 2 heartbeats").
SLOW_HEARTBEAT = {"interval_s": 0.5, "max_failures": 30}


@pytest.mark.parametrize("backend", BACKENDS)
def test_byte_exact_handoff_up_to_64_mib(cluster, backend):
    p = cluster("prefill", backend, LARGE)
    d = cluster("decode", backend, LARGE)
    rooms = {1: [7], 2: [3, 4, 5, 90, 91], 3: list(range(200, 237)), 4: list(range(1, 513))}
    for room, pages in rooms.items():
        transfer(p, d, room, pages)
        assert d("wait", room=room, timeout=120)["state"] == "Success"
        assert p("wait", room=room, timeout=60)["state"] == "Success"
        assert d("digest", room=room)["digest"] == p("digest", room=room, pages=pages)["digest"], room
        d("finish", room=room)
    assert p("counters")["open_transfer_entries"] == 0 and p("counters")["staging_buffers_held"] == 0
    counters = d("counters")
    assert counters["pages_reserved"] == 0 and counters["pulled_awaiting_scatter"] == 0
    p.stop(), d.stop()
    result = assert_replay_consistent(p.journal, d.journal)
    assert {r.final for r in result.rooms} == {"Success"} and len(result.rooms) == 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_pools_on_a_two_device_mesh(cluster, backend):
    env = {"XLA_FLAGS": with_host_devices(2)}
    layout = KVLayout(num_layers=2, num_pages=32, page_size=4, kv_heads=4, head_dim=8, shard_axis="kv")
    p = cluster("prefill", backend, layout, env=env)
    d = cluster("decode", backend, layout, env=env)
    assert p.info["devices"] == 2 and d.info["devices"] == 2
    transfer(p, d, 1, [2, 3, 9, 10, 11])
    assert d("wait", room=1)["state"] == "Success", d("state", room=1)
    assert d("digest", room=1)["digest"] == p("digest", room=1, pages=[2, 3, 9, 10, 11])["digest"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_killed_before_the_pull(cluster, backend):
    p = cluster("prefill", backend, deadlines={"pull_hold": 5})
    d = cluster("decode", backend, deadlines={"transfer": 3}, pull_delay=1.0, heartbeat=SLOW_HEARTBEAT)
    transfer(p, d, 1, [1, 2, 3])
    wait_for_state(d, 1, "Transferring")  # READY arrived; the pull starts in 1 s
    p.kill()
    assert d("wait", room=1, timeout=10)["state"] == "Failed"
    state, reason, _, failed_at = final(d.journal, 1)
    ready_at = next(r.at for r in read_journal(d.journal) if r.trigger == "kv_published")
    assert failed_at - ready_at <= 3.5, "failed within the transfer deadline"
    assert "error" in reason or "timeout" in reason
    assert d("counters")["pages_reserved"] == 0
    restarted = p.start()  # the prefill node comes back on its journal and fails what it left unfinished
    assert restarted["recovered"] == [1]
    assert p("wait", room=1)["state"] == "Failed"
    assert final(p.journal, 1)[1] == "local error: node restarted"
    assert p("counters")["open_transfer_entries"] == 0
    p.stop(), d.stop()
    assert_replay_consistent(p.journal, d.journal)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_killed_during_the_pull(cluster, backend):
    p = cluster("prefill", backend, LARGE, deadlines={"pull_hold": 30})
    d = cluster("decode", backend, LARGE, deadlines={"transfer": 4}, heartbeat=SLOW_HEARTBEAT)
    transfer(p, d, 1, list(range(1, 513)))  # 64 MiB
    wait_for_state(d, 1, "Transferring")
    p.proc.send_signal(signal.SIGSTOP)  # freeze the producer with the pull under way, then kill it
    time.sleep(0.5)
    p.kill()
    assert d("wait", room=1, timeout=15)["state"] == "Failed"
    _, reason, _, failed_at = final(d.journal, 1)
    ready_at = next(r.at for r in read_journal(d.journal) if r.trigger == "kv_published")
    assert failed_at - ready_at <= 4.5 and "pull" in reason
    assert d("counters")["pages_reserved"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_killed_before_pulling_frees_the_prefill_hold(cluster, backend):
    p = cluster("prefill", backend, deadlines={"pull_hold": 2}, heartbeat=SLOW_HEARTBEAT)
    d = cluster("decode", backend, pull_delay=30, heartbeat=SLOW_HEARTBEAT)
    transfer(p, d, 1, [4, 5])
    wait_for_state(d, 1, "Transferring")
    d.kill()
    assert p("wait", room=1, timeout=10)["state"] == "Failed"
    _, reason, _, _ = final(p.journal, 1)
    assert reason == "pull_hold timeout"
    counters = p("counters")
    assert counters["open_transfer_entries"] == 0 and counters["staging_buffers_held"] == 0
    p.stop()
    assert_replay_consistent(p.journal, d.journal)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_failure_makes_a_late_pull_fail_fast(cluster, backend):
    p = cluster("prefill", backend)
    d = cluster("decode", backend, pull_delay=1.0)
    transfer(p, d, 1, [6, 7])
    wait_for_state(d, 1, "Transferring")
    p("abort", room=1, reason="prefill gave up")
    assert d("wait", room=1)["state"] == "Failed"
    assert final(d.journal, 1)[1] == "aborted by peer: prefill gave up"
    # the delayed pull (1 s after READY) runs against the failed entry and must come back at once
    assert until(lambda: any(r.trigger == "error" for r in read_journal(d.journal)), 30), "the late pull never ended"
    late = [r for r in read_journal(d.journal) if r.trigger == "error"]
    assert "ignored" in late[0].payload, "the late pull's failure lands on a finished room"
    started = next(r.at for r in read_journal(d.journal) if r.trigger == "kv_published") + 1.0
    assert late[0].at - started < 1.0, "the pull of a failed entry failed fast instead of hanging"
    assert d("counters")["pages_reserved"] == 0 and p("counters")["open_transfer_entries"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_mismatch_fails_both_sides_before_anything_moves(cluster, backend):
    p = cluster("prefill", backend)
    other = KVLayout(num_layers=2, num_pages=64, page_size=4, kv_heads=2, head_dim=16)
    d = cluster("decode", backend, other)
    transfer(p, d, 1, [1, 2])
    assert p("wait", room=1)["state"] == "Failed" and d("wait", room=1)["state"] == "Failed"
    assert final(p.journal, 1)[1] == "layout mismatch"
    assert final(d.journal, 1)[1] == "aborted by peer: layout mismatch"
    assert d("counters")["pages_reserved"] == 0 and p("counters")["staging_buffers_held"] == 0


def pull_done_rows(journal, room: int) -> int:
    return sum(r.room == room and r.trigger == "pull_done" for r in read_journal(journal))


@pytest.mark.parametrize("backend", BACKENDS)
def test_forged_unsigned_and_duplicate_messages_change_nothing(cluster, backend):
    p = cluster("prefill", backend)
    d = cluster("decode", backend, pull_delay=0.5)
    transfer(p, d, 1, [3, 4])
    wait_for_state(d, 1, "Transferring")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(d.info["side_channel"])
    forged = Abort(room=1, sender="prefill-0", instance="forged", origin=d.info["side_channel"], nonce=12345,
                   sent_at=time.time(), reason="forged")
    push.send(seal(forged, b"not the cluster secret, just 32 bytes long!"))
    push.send(b"\x01\x04unsigned garbage")
    assert d("wait", room=1)["state"] == "Success"
    assert p("wait", room=1)["state"] == "Success"
    dropped = d("counters")["side_channel_dropped"]
    assert dropped["bad_mac"] >= 1 and sum(dropped.values()) >= 2
    # a second, validly signed PULLED for the finished room: delivered once at most, never a state change
    duplicate = Pulled(room=1, sender="decode-0", instance="replayed", origin=d.info["side_channel"], nonce=999,
                       sent_at=time.time(), transfer_id=1)
    push.disconnect(d.info["side_channel"])
    push.connect(p.info["side_channel"])
    push.send(seal(duplicate, cluster.secret))
    push.close()
    ctx.term()
    # P's loop decided the duplicate once its row is journaled: only then can "nothing changed" be told
    assert until(lambda: pull_done_rows(p.journal, 1) == 2, 30), "the duplicate PULLED never reached P's loop"
    assert p("state", room=1)["state"] == "Success"
    p.stop(), d.stop()
    assert_replay_consistent(p.journal, d.journal)
    assert [r.trigger for r in read_journal(p.journal) if r.room == 1 and r.src != r.dst][-1] == "pull_done"
