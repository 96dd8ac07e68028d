"""Handoffs between different tensor-parallel sizes, on 4 virtual CPU devices, over real sockets on 127.0.0.1.

Not collected by a plain ``pytest`` run: ``tests/integration/test_tp_transfer.py`` runs this file in a fresh
interpreter with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (jax fixes its CPU device count when it
first creates the CPU client). By hand::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest tests/integration/tp_transfer_check.py

A prefill and a decode ``KVManager`` per split (prefill on the first ``tp_p`` devices, decode on the first
``tp_d``), their pools filled from one seeded array of model heads (each pool holds it the way its split lays it
out). Each room hands pages over from one split to another; the reference room hands the same pages from a prefill
node split like the decode node. D's pool bytes for the two rooms must be equal, and equal to the model heads laid
out the decode node's way.
"""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from pool_admission import pool_admission

from fsm_pd.control import KVManager
from fsm_pd.effects.faults import FaultConfig, Faults
from fsm_pd.kernels import KVLayout, gather_pages
from fsm_pd.kernels.layout import PAD_HEAD
from fsm_pd.store import read_journal, replay
from fsm_pd.transport import generate_secret
from fsm_pd.transport.reshard import piece_uuid

PAGES = [3, 4, 9, 10, 11]  # the prefill pages of every room
SIZES = (1, 2, 4)


@pytest.fixture(scope="module", autouse=True)
def four_devices():
    if jax.device_count() != 4:
        pytest.fail(f"needs XLA_FLAGS=--xla_force_host_platform_device_count=4, found {jax.device_count()} devices")


def layout(kv_heads: int, tp: int) -> KVLayout:
    return KVLayout(num_layers=2, num_pages=24, page_size=4, kv_heads=kv_heads, head_dim=8,
                    shard_axis="tp" if tp > 1 else None, tp=tp)


def model_heads(kv_heads: int) -> list[np.ndarray]:
    """The KV every prefill pool holds, per layer ``[pages, page_size, 2 * kv_heads * head_dim]``."""
    rng = np.random.default_rng(kv_heads)
    shape = (24, 4, 2 * kv_heads * 8)
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(2)]


def laid_out(heads: np.ndarray, lay: KVLayout) -> np.ndarray:
    """Model heads ``[..., 2 * kv_heads * D]`` as ``lay``'s slots ``[..., 2 * slots * D]`` (padding slots zero)."""
    out = np.zeros((*heads.shape[:-1], 2 * lay.slots * lay.head_dim), heads.dtype)
    for slot, head in enumerate(lay.slot_heads):
        if head != PAD_HEAD:
            out[..., lay.slot_lanes(slot, 1)] = heads[..., lay.slot_lanes(head, 1)]
    return out


def place(arrays: list[np.ndarray], lay: KVLayout) -> tuple:
    if lay.tp == 1:
        return tuple(jax.device_put(a, jax.devices()[0]) for a in arrays)
    sharding = NamedSharding(Mesh(np.array(jax.devices()[: lay.tp]), ("tp",)), lay.pool_spec())
    return tuple(jax.device_put(a, sharding) for a in arrays)


class Cluster:
    """Prefill and decode managers per (KV heads, tp), made on first use."""

    def __init__(self, tmp, backend: str):
        self.tmp, self.backend, self.secret = tmp, backend, generate_secret()
        self.nodes: dict[tuple, KVManager] = {}
        self.room = 0

    def node(self, role: str, kv_heads: int, tp: int) -> KVManager:
        key = (role, kv_heads, tp)
        if key not in self.nodes:
            lay = layout(kv_heads, tp)
            content = [laid_out(h, lay) for h in model_heads(kv_heads)] if role == "prefill" else [
                np.zeros(lay.layer_shape, np.float32) for _ in range(2)]
            name = f"{role}-{kv_heads}-{tp}"
            self.nodes[key] = KVManager(role=role, node_id=name, layout=lay, journal=str(self.tmp / f"{name}.db"),
                                        secret=self.secret, backend=self.backend, pool=place(content, lay),
                                        deadlines={"transfer": 20} if role == "decode" else {"pull_hold": 20},
                                        admission=pool_admission(lay.num_pages) if role == "decode" else None)
        return self.nodes[key]

    def hand_over(self, kv_heads: int, tp_p: int, tp_d: int, *, before_pull=None) -> tuple[int, KVManager, KVManager]:
        p, d = self.node("prefill", kv_heads, tp_p), self.node("decode", kv_heads, tp_d)
        self.room += 1
        room = self.room
        p.add_sender(room, PAGES, prompt_len=len(PAGES) * 4)
        p.kv_ready(room, first_token=7)
        d.add_receiver(room, len(PAGES), prefill_addr=p.side_channel.address)
        if before_pull is not None:
            before_pull(room, p, d)
        return room, p, d

    def close(self):
        for node in self.nodes.values():
            node.close()


def pool_pages(manager: KVManager, pages: list[int]) -> np.ndarray:
    lay = manager.layout
    staged = manager.model.call(lambda owner: np.asarray(gather_pages(owner.pool, pages, layout=lay)))
    return staged[:, : len(pages)]


def settled(manager: KVManager, room: int) -> None:
    manager.finish(room)
    manager.model.call(lambda owner: None)


def no_leaks(p: KVManager, d: KVManager) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pc, dc = p.counters(), d.counters()
        if (pc["open_transfer_entries"], pc["staging_buffers_held"], dc["pages_reserved"],
                dc["pulled_awaiting_scatter"]) == (0, 0, 0, 0):
            return
        time.sleep(0.05)
    raise AssertionError(f"held after the room ended: prefill {p.counters()}, decode {d.counters()}")


@pytest.fixture
def cluster(tmp_path, request):
    made = Cluster(tmp_path, request.param)
    yield made
    made.close()


PAIRS = [(1, 2), (2, 4), (4, 1), (2, 1), (1, 4), (4, 2)]


# KV heads 4: >= every TP here; 2: < TP 4 (copies); 3: divides neither 2 nor 4 (padding)
@pytest.mark.parametrize("cluster", ["tcp"], indirect=True)
@pytest.mark.parametrize("kv_heads", [4, 2, 3])
def test_d_holds_the_bytes_of_a_same_tp_handoff(cluster, kv_heads):
    heads = model_heads(kv_heads)
    for tp_p, tp_d in PAIRS:
        room, p, d = cluster.hand_over(kv_heads, tp_p, tp_d)
        assert d.wait(room, 30).name == "Success", (tp_p, tp_d, d.reason(room))
        assert p.wait(room, 30).name == "Success", (tp_p, tp_d, p.reason(room))
        pages = d.admission.allocator.pages_of(room)
        got = pool_pages(d, pages)
        ref_room, _, ref_d = cluster.hand_over(kv_heads, tp_d, tp_d)  # the same pages, from a prefill split like D
        assert ref_d is d and d.wait(ref_room, 30).name == "Success", d.reason(ref_room)
        same_tp = pool_pages(d, d.admission.allocator.pages_of(ref_room))
        assert got.tobytes() == same_tp.tobytes(), f"{tp_p} -> {tp_d}: D's bytes differ from a same-TP handoff"
        want = np.stack([laid_out(h[PAGES], d.layout) for h in heads])
        assert got.tobytes() == want.tobytes(), f"{tp_p} -> {tp_d}: D does not hold the model heads its way"
        for r in (room, ref_room):
            settled(d, r)
        no_leaks(p, d)


@pytest.mark.parametrize("cluster", ["zmq", "jax"], indirect=True)
def test_other_backends_reshard_too(cluster):
    for tp_p, tp_d in [(2, 4), (4, 1), (1, 2)]:
        room, p, d = cluster.hand_over(2, tp_p, tp_d)
        assert d.wait(room, 30).name == "Success", (tp_p, tp_d, d.reason(room))
        got = pool_pages(d, d.admission.allocator.pages_of(room))
        assert got.tobytes() == np.stack([laid_out(h[PAGES], d.layout) for h in model_heads(2)]).tobytes()
        settled(d, room)
        no_leaks(p, d)


@pytest.mark.parametrize("cluster", ["tcp"], indirect=True)
def test_a_failed_piece_fails_the_room_and_names_its_shards(cluster):
    """P publishes its pieces; before D pulls, one piece's hold is failed (a shard lost): the room fails once, with a
    reason naming the piece and both shards, and no piece's hold or pulled buffer is left anywhere."""
    d = cluster.node("decode", 4, 2)
    no_faults = d.effects.faults
    d.effects.faults = Faults(FaultConfig(pull_delay_s=0.5), role="decode")  # the pulls wait: time to lose a piece

    def lose_piece(room, p, d):
        deadline = time.monotonic() + 10
        while room not in p.effects.staging or "published" not in p.node.rooms[room].seen:
            assert time.monotonic() < deadline, "never published"
            time.sleep(0.01)
        uuid, pieces = p.effects.staging[room]
        assert pieces == 2  # 1 -> 2: one piece per decode shard
        p.backend.fail(piece_uuid(uuid, 1), "shard lost in the test")

    room, p, d = cluster.hand_over(4, 1, 2, before_pull=lose_piece)
    assert d.wait(room, 30).name == "Failed"
    reason = d.reason(room)
    assert "piece 1 (prefill shard 0 -> decode shard 1)" in reason and "shard lost in the test" in reason, reason
    assert p.wait(room, 30).name == "Failed"
    assert "piece 1 (prefill shard 0 -> decode shard 1)" in p.reason(room), p.reason(room)
    no_leaks(p, d)
    d.effects.faults = no_faults
    room, p, d = cluster.hand_over(4, 1, 2)  # the same nodes serve the next room
    assert d.wait(room, 30).name == "Success", d.reason(room)
    settled(d, room)
    no_leaks(p, d)
    # the journals replay, and say per piece what moved: P how many pieces it published, D from which prefill shard
    # into which decode shard each came, and how many bytes
    rows = [row for node in (p, d) for row in read_journal(node.journal.url)]
    assert replay(rows).consistent
    published = next(r for r in rows if r.room == room and r.trigger == "published")
    pulled = next(r for r in rows if r.room == room and r.trigger == "pulled")
    assert published.payload["event"]["pieces"] == 2
    assert [piece[:2] for piece in pulled.payload["event"]["pieces"]] == [[0, 0], [0, 1]]
