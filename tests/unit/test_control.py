"""The control plane in one process: facades, aborts in both directions, early messages, heartbeat, metrics.

Two KVManagers talk over the real side channel on 127.0.0.1 (unix sockets on a host without TCP:
``node_sockets.py``) and the in-process ``fake`` data plane; the journals are real SQLite files.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from node_sockets import node_sockets
from polling import until
from pool_admission import pool_admission
from prometheus_client import generate_latest

from fsm_pd.control import KVManager, resolve_deadlines
from fsm_pd.control.admission import SchedulerAdmission
from fsm_pd.control.facades import KVReceiver, KVSender, KVTransferError
from fsm_pd.kernels import KVLayout, gather_pages
from fsm_pd.machines import KVPoll
from fsm_pd.store import read_journal, replay
from fsm_pd.transport import generate_secret

LAYOUT = KVLayout(num_layers=2, num_pages=32, page_size=4, kv_heads=1, head_dim=8)


def pool(seed):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(LAYOUT.layer_shape, dtype=np.float32) if seed else
                             np.zeros(LAYOUT.layer_shape, np.float32)) for _ in range(LAYOUT.num_layers))


@pytest.fixture
def pair(tmp_path):
    made = []

    def make(decode_admission=None, **deadlines):
        secret = generate_secret()
        p = KVManager(role="prefill", node_id="p0", layout=LAYOUT, journal=str(tmp_path / "p.db"), secret=secret,
                      backend="fake", pool=pool(1), deadlines={k: v for k, v in deadlines.items()
                                                               if k in ("bootstrap", "waiting", "pull_hold")},
                      **node_sockets(tmp_path, "p"))
        d = KVManager(role="decode", node_id="d0", layout=LAYOUT, journal=str(tmp_path / "d.db"), secret=secret,
                      backend="fake", pool=pool(0),
                      admission=decode_admission or pool_admission(LAYOUT.num_pages),
                      deadlines={k: v for k, v in deadlines.items() if k in ("bootstrap", "waiting", "transfer")},
                      **node_sockets(tmp_path, "d"))
        made.extend([p, d])
        return p, d

    yield make
    for m in made:
        m.close()


def test_a_decode_manager_without_an_admission_is_refused_before_it_opens_anything(tmp_path):
    with pytest.raises(ValueError, match="needs an admission"):
        KVManager(role="decode", node_id="d0", layout=LAYOUT, journal=str(tmp_path / "d.db"),
                  secret=generate_secret(), backend="fake", pool=pool(0))
    assert not (tmp_path / "d.db").exists()  # refused before its journal was created


def test_sglang_facades_drive_a_chunked_transfer(pair, tmp_path):
    freed = []
    p, d = pair(decode_admission=SchedulerAdmission(on_release=freed.append))
    sender = KVSender(p, None, 5)
    receiver = KVReceiver(d, None, 5)
    assert sender.poll() == KVPoll.Bootstrapping
    # no bootstrap server here: the decode node is told where the prefill node is
    d.resolver = lambda ctx: {"prefill_addr": p.side_channel.address, "peer": "p0"}
    receiver.init(prefill_dp_rank=0)
    receiver.send_metadata([9, 10, 11])
    assert until(lambda: p.poll(5) == KVPoll.WaitingForInput)  # PREPARE is in: P's KV is all the transfer waits for
    sender.init(3)
    sender.send([4])
    # Two pages are still missing: nothing may move yet. A room made now is queued behind whatever that send
    # submitted; once P's loop has it, a premature start would show.
    p.add_sender(6, [1])
    assert until(lambda: p.poll(6) is not None)
    assert p.poll(5) == KVPoll.WaitingForInput
    sender.send([7, 8], first_token=42)
    assert d.wait(5, 10) == KVPoll.Success and p.wait(5, 10) == KVPoll.Success
    assert receiver.poll() == KVPoll.Success and sender.poll() == KVPoll.Success
    got = np.asarray(d.model.call(lambda o: gather_pages(o.pool, [9, 10, 11])))[:, :3]
    want = np.asarray(p.model.call(lambda o: gather_pages(o.pool, [4, 7, 8])))[:, :3]
    assert np.array_equal(got, want)
    assert d.node.rooms[5].ctx["first_token"] == 42
    sender.clear()
    receiver.clear()
    # a clear is queued to the node's loop like an event (rooms change only there)
    assert until(lambda: p.poll(5) is None and d.poll(5) is None) and freed == []


def test_decode_abort_reaches_prefill_and_frees_pages(pair):
    p, d = pair()
    p.add_sender(1, [3, 4])
    d.add_receiver(1, page_count=2, prefill_addr=p.side_channel.address)
    assert until(lambda: p.poll(1) == KVPoll.WaitingForInput)
    d.abort(1, "client went away")
    assert p.wait(1, 5) == KVPoll.Failed and d.wait(1, 5) == KVPoll.Failed
    assert p.reason(1) == "aborted by peer: client went away"
    assert until(lambda: d.counters()["pages_reserved"] == 0)
    with pytest.raises(KVTransferError, match="client went away"):
        KVReceiver(d, None, 1).failure_exception()


def test_prefill_abort_reaches_decode(pair):
    p, d = pair()
    p.add_sender(2, [3])
    d.add_receiver(2, page_count=1, prefill_addr=p.side_channel.address)
    assert until(lambda: d.poll(2) == KVPoll.WaitingForInput and p.poll(2) == KVPoll.WaitingForInput)
    p.abort(2, "prefill out of memory")
    assert d.wait(2, 5) == KVPoll.Failed
    assert d.reason(2) == "aborted by peer: prefill out of memory"


def test_prepare_that_beats_the_request_to_prefill_is_kept(pair):
    p, d = pair()
    d.add_receiver(3, page_count=1, prefill_addr=p.side_channel.address)
    assert until(lambda: p.core.early_rooms() == 1)  # PREPARE reached the prefill node before it knows room 3
    assert p.poll(3) is None
    p.add_sender(3, [5])
    p.kv_ready(3)
    assert d.wait(3, 10) == KVPoll.Success and p.wait(3, 10) == KVPoll.Success


def test_deadlines_fail_rooms_and_replay_explains_them(pair, tmp_path):
    p, d = pair(bootstrap=0.3, waiting=0.4)
    p.add_sender(4, [1])  # no decode side ever asks: bootstrap deadline
    d.add_receiver(6, page_count=1, prefill_addr=p.side_channel.address)
    p.add_sender(6, [2])  # PREPARE arrives, prefill never finishes: waiting deadlines on both sides
    assert p.wait(4, 5) == KVPoll.Failed and p.reason(4) == "bootstrap timeout"
    assert d.wait(6, 5) == KVPoll.Failed and d.reason(6) == "waiting timeout"
    assert p.wait(6, 5) == KVPoll.Failed
    p.close(), d.close()
    result = replay(read_journal(tmp_path / "p.db") + read_journal(tmp_path / "d.db"))
    assert result.consistent
    ended = {(r.role, r.room): (r.ended_by, r.reason) for r in result.rooms}
    assert ended[("prefill", 4)] == ("timeout", "bootstrap timeout")
    assert ended[("decode", 6)] == ("timeout", "waiting timeout")
    # the prefill side either timed out itself or heard the decode side's ABORT first
    assert ended[("prefill", 6)] in {("timeout", "waiting timeout"), ("peer_abort", "aborted by peer: waiting timeout")}


def test_metrics_count_transitions_and_failures(pair):
    p, d = pair(bootstrap=0.2)
    p.add_sender(1, [1])
    assert p.wait(1, 5) == KVPoll.Failed
    text = generate_latest(p.metrics.registry).decode()
    assert 'fsm_pd_failures_total{node="p0",reason="bootstrap timeout",role="prefill"} 1.0' in text
    assert 'fsm_pd_rooms{node="p0",role="prefill",state="Failed"} 1.0' in text
    p.clear(1)  # queued to the loop
    assert until(lambda: 'state="Failed"} 0.0' in generate_latest(p.metrics.registry).decode())


def test_deadline_configuration(monkeypatch):
    assert resolve_deadlines("decode")["waiting"] == 300.0
    assert resolve_deadlines("prefill", environ={"FSM_PD_PULL_HOLD_TIMEOUT": "7"})["pull_hold"] == 7.0
    assert resolve_deadlines("prefill", {"bootstrap": 3}, environ={"FSM_PD_BOOTSTRAP_TIMEOUT": "9"})["bootstrap"] == 3
    with pytest.raises(ValueError, match="FSM_PD_WAITING_TIMEOUT"):
        resolve_deadlines("decode", environ={"FSM_PD_WAITING_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="unknown prefill deadline"):
        resolve_deadlines("prefill", {"transfer": 1})
    with pytest.raises(ValueError, match="positive"):
        resolve_deadlines("decode", {"transfer": 0})



class BlockingChannel:
    """A side channel whose sends to ``dead`` block until ``release`` is set, then fail like a dead ZMQ peer."""

    address = "tcp://127.0.0.1:1"

    def __init__(self):
        import threading

        self.release = threading.Event()
        self.blocked = threading.Event()
        self.sent: list[tuple[str, object]] = []
        self.waited_out = False  # a send blocked until its wait ran out: whoever called it was stuck that long

    def send(self, addr, msg):
        from fsm_pd.transport import PeerUnreachable

        if addr == "tcp://dead:1":
            self.blocked.set()
            self.waited_out |= not self.release.wait(30)
            raise PeerUnreachable(f"{addr}: no live connection within 1000 ms")
        self.sent.append((addr, msg))

    def forget_peer(self, addr):
        pass


def test_a_send_to_a_dead_peer_blocks_neither_the_loop_nor_other_peers():
    from fsm_pd.control.sending import PeerSenders
    from fsm_pd.effects import EffectInterpreter, Node, VirtualClock
    from fsm_pd.effects.faults import Faults
    from fsm_pd.effects.outbox import Outbox
    from fsm_pd.machines import SENDER
    from fsm_pd.machines.effect_types import Send

    channel = BlockingChannel()
    senders = PeerSenders(channel)
    outbox = Outbox(senders, Faults(), peer="decode node", best_effort=frozenset({"ABORT"}), crash_after={})

    def send(node, room, effect):
        outbox.send(node, room.room, room.ctx["reply_to"], f"{effect.kind} {room.room}", effect.kind)

    layout = {"num_layers": 1, "num_pages": 4, "page_size": 2, "kv_heads": 1, "head_dim": 4}
    node = Node("p", SENDER, None, EffectInterpreter({Send: send}), VirtualClock(),
                {"bootstrap": 5.0, "waiting": 5.0, "pull_hold": 5.0})
    for room, addr in ((1, "tcp://dead:1"), (2, "tcp://dead:1"), (3, "tcp://live:1")):
        node.create(room, {"layout": layout})
        node.submit(room, "metadata_received", {"peer_layout": layout, "reply_to": addr})
        node.submit(room, "abort" if room != 2 else "error", {"reason": "client went away"})
    node.step()  # sends ABORT to the dead peer twice and to the live one: returns without waiting for any of them
    assert not channel.waited_out, "the node loop waited for a send to a dead peer"
    try:
        assert channel.blocked.wait(10)
        assert until(lambda: ("tcp://live:1", "ABORT 3") in channel.sent, 10)  # while the dead peer still blocks
    finally:
        channel.release.set()
    # ABORT is best effort: a dead peer's deadlines end its side, so nothing more happens to the rooms
    assert until(lambda: senders.pending() == 0)
    assert node.step() == 0
    senders.close()


def test_a_dead_peer_fails_everything_queued_for_it_at_once():
    import threading

    from fsm_pd.control.sending import PeerSenders
    from fsm_pd.transport import PeerUnreachable

    channel = BlockingChannel()
    senders = PeerSenders(channel)
    outcomes, all_done = [], threading.Event()

    def done(error):
        outcomes.append(error)
        if len(outcomes) == 3:
            all_done.set()

    for n in range(3):
        senders.post("tcp://dead:1", f"PREPARE {n}", done)
    assert channel.blocked.wait(10)
    channel.release.set()
    assert all_done.wait(10)  # one timeout for the burst, not one per message
    assert all(isinstance(e, PeerUnreachable) for e in outcomes)
    senders.close()
