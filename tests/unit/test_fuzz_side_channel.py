"""Fuzzing the side channel of running KV managers: garbage and mutated frames for live rooms change nothing.

tests/unit/test_messages.py fuzzes the codec (random and mutated frames raise only the documented errors) and
tests/integration/test_side_channel.py checks that a bare ``SideChannel`` drops and counts each kind of bad frame.
What is added here: a prefill and a decode ``KVManager`` with transfers in flight (rooms parked in WaitingForInput on
both sides), and a raw ZMQ socket that sends each of them hundreds of random, mutated, forged, stale, replayed,
oversized and multi-part frames naming those rooms. Then: every frame was dropped and counted, no handler failed,
no live room changed state or got a journal row, and the same rooms (and a fresh one) still complete normally, so no
room is left stuck.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import random
import sqlite3
import time

import jax.numpy as jnp
import numpy as np
import pytest
import zmq
from node_sockets import node_sockets
from polling import until
from pool_admission import pool_admission

from fsm_pd.control import KVManager
from fsm_pd.kernels import KVLayout
from fsm_pd.machines import KVPoll
from fsm_pd.store import read_journal, replay
from fsm_pd.transport import Abort, Heartbeat, Prepare, Pulled, Ready, generate_secret
from fsm_pd.transport.messages import MessageType
from fsm_pd.transport.signing import WIRE_VERSION, seal

LAYOUT = KVLayout(num_layers=2, num_pages=32, page_size=4, kv_heads=1, head_dim=8)
LIVE = (11, 12, 13)
FRAMES_PER_NODE = 400


def pool(seed: int):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(LAYOUT.layer_shape, dtype=np.float32))
                 for _ in range(LAYOUT.num_layers))


def journal_rows(path) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(f"SELECT count(*) FROM transitions WHERE room IN {LIVE}").fetchone()[0]
    finally:
        conn.close()


def valid_messages(stamp, rooms) -> list:
    """One validly stamped message of every type for each room: what an attacker would like to inject."""
    layout = LAYOUT.to_dict()
    out = []
    for room in rooms:
        out += [stamp(Prepare, room=room, transfer_id=room, reply_to="tcp://127.0.0.1:9", layout=layout,
                      page_count=2, prompt_len=5),
                stamp(Ready, room=room, transfer_id=room, uuid=room, transfer_addr="127.0.0.1:9", backend="fake",
                      layout=layout, page_count=2, first_token=1, first_logprob=-1.0, input_logprobs=[-1.0]),
                stamp(Pulled, room=room, transfer_id=room), stamp(Abort, room=room, reason="forged")]
    return out + [stamp(Heartbeat, room=0, pong=False), stamp(Heartbeat, room=0, pong=True)]


def garbage(rng: random.Random, stamp, secret: bytes) -> list[bytes | list[bytes]]:
    """Frames that must all be dropped: none carries a fresh, correctly signed, never-seen message."""
    forger = generate_secret()
    msgs = valid_messages(stamp, LIVE)
    frames: list[bytes | list[bytes]] = []
    while len(frames) < FRAMES_PER_NODE:
        msg = rng.choice(msgs)
        good = seal(dataclasses.replace(msg, nonce=rng.getrandbits(63)), secret)
        kind = rng.randrange(10)
        if kind == 0:  # random bytes of any length, sometimes with a plausible header
            frame = rng.randbytes(rng.randrange(0, 300))
            frames.append(bytes((WIRE_VERSION, rng.randrange(1, 7))) + frame if rng.random() < 0.5 else frame)
        elif kind == 1:  # a flipped bit anywhere
            i = rng.randrange(len(good))
            frames.append(good[:i] + bytes((good[i] ^ (1 << rng.randrange(8)),)) + good[i + 1:])
        elif kind == 2:  # truncated, or with bytes appended
            frames.append(good[: rng.randrange(len(good))] if rng.random() < 0.5
                          else good + rng.randbytes(rng.randrange(1, 40)))
        elif kind == 3:  # signed with another secret
            frames.append(seal(msg, forger))
        elif kind == 4:  # the type byte of another message (the MAC covers it)
            other = rng.choice([t for t in MessageType if t != good[1]])
            frames.append(good[:1] + bytes((other,)) + good[2:])
        elif kind == 5:  # correctly signed, but far too old or from the future
            skew = rng.choice((-1, 1)) * rng.uniform(120, 10**6)
            frames.append(seal(dataclasses.replace(msg, nonce=rng.getrandbits(63), sent_at=time.time() + skew),
                               secret))
        elif kind == 6:  # another wire version (1: before instances)
            frames.append(bytes((rng.choice([0, 1, 3, 255]),)) + good[1:])
        elif kind == 7:  # a valid frame in two parts
            frames.append([good, rng.randbytes(rng.randrange(0, 20))])
        elif kind == 8:  # bigger than max_frame_bytes (below libzmq's hard cap, so it is counted)
            frames.append(good + bytes(1024 * 1024))
        else:  # correctly signed bytes that are not a message body
            body = rng.randbytes(rng.randrange(0, 60))
            header = bytes((WIRE_VERSION, rng.randrange(1, 7)))
            frames.append(header + body + hmac.new(secret, header + body, hashlib.sha256).digest())
    return frames


@pytest.fixture
def pair(tmp_path):
    secret = generate_secret()
    p = KVManager(role="prefill", node_id="p0", layout=LAYOUT, journal=str(tmp_path / "p.db"), secret=secret,
                  backend="fake", pool=pool(1), **node_sockets(tmp_path, "p"))
    d = KVManager(role="decode", node_id="d0", layout=LAYOUT, journal=str(tmp_path / "d.db"), secret=secret,
                  backend="fake", pool=pool(2), admission=pool_admission(LAYOUT.num_pages),
                  **node_sockets(tmp_path, "d"))
    yield p, d, secret
    p.close()
    d.close()


def test_garbage_frames_for_live_rooms_change_nothing_and_the_rooms_still_complete(pair, tmp_path):
    p, d, secret = pair
    for room in LIVE:
        p.add_sender(room, [room % 8 + 1, room % 8 + 2])
        d.add_receiver(room, page_count=2, prefill_addr=p.side_channel.address)
    assert until(lambda: all(p.poll(r) == KVPoll.WaitingForInput and d.poll(r) == KVPoll.WaitingForInput
                             for r in LIVE))
    before = {"p": journal_rows(tmp_path / "p.db"), "d": journal_rows(tmp_path / "d.db")}
    dropped_before = {"p": sum(p.side_channel.dropped.values()), "d": sum(d.side_channel.dropped.values())}

    rng = random.Random(7)
    ctx = zmq.Context()
    try:
        sent = {}
        for name, manager, sender in (("p", p, d), ("d", d, p)):
            frames = garbage(rng, sender.side_channel.stamp, secret)
            # one frame twice: the first copy is a fresh, valid ABORT for a room nobody has (kept as an early
            # message, bounded); the second is a replay and must be dropped
            replayed = seal(sender.side_channel.stamp(Abort, room=999_999, reason="early"), secret)
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 2000)
            push.setsockopt(zmq.SNDHWM, 0)
            push.connect(manager.side_channel.address)
            push.send(replayed)
            for frame in frames:
                if isinstance(frame, list):
                    push.send_multipart(frame)
                else:
                    push.send(frame)
            push.send(replayed)
            push.close()
            sent[name] = len(frames) + 1  # every garbage frame and the replay
        for name, manager in (("p", p), ("d", d)):
            assert until(lambda m=manager, n=name: sum(m.side_channel.dropped.values()) - dropped_before[n]
                         >= sent[n], timeout_s=30), (name, manager.side_channel.dropped)
            counts = manager.side_channel.dropped
            assert sum(counts.values()) - dropped_before[name] == sent[name], counts
            assert counts["replayed"] >= 1 and counts["bad_mac"] > 0 and counts["stale"] > 0, counts
            assert counts["oversized"] > 0 and counts["malformed"] > 0 and counts["bad_version"] > 0, counts
            assert manager.side_channel.handler_errors == 0
    finally:
        ctx.term()

    # Every frame has been handled, and what a handler does to a room it queues for the node's loop. A fresh room
    # created now queues behind all of it: once each loop has the room, it has decided everything the frames caused.
    p.add_sender(20, [7])
    d.add_receiver(20, page_count=1, prefill_addr=p.side_channel.address)
    assert until(lambda: p.poll(20) is not None and d.poll(20) is not None)
    # nothing moved: same states, not a single journal row for the live rooms
    assert all(p.poll(r) == KVPoll.WaitingForInput and d.poll(r) == KVPoll.WaitingForInput for r in LIVE)
    assert {"p": journal_rows(tmp_path / "p.db"), "d": journal_rows(tmp_path / "d.db")} == before

    # valid traffic still flows: the parked transfers complete, and so does the new one
    for room in LIVE:
        p.kv_ready(room, first_token=5)
    p.kv_ready(20)
    for room in (*LIVE, 20):
        assert d.wait(room, 15) == KVPoll.Success and p.wait(room, 15) == KVPoll.Success, room
        assert d.node.rooms[room].ctx["first_token"] == (5 if room in LIVE else 0)
    p.close(), d.close()
    result = replay(read_journal(tmp_path / "p.db") + read_journal(tmp_path / "d.db"))
    assert result.consistent and {r.final for r in result.rooms} == {"Success"}
