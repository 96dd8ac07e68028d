"""The resharding plan (``transport/reshard.py``): pure, so checked byte by byte on NumPy arrays.

The property: for any KV head count, head size, page size, pair of tensor-parallel sizes and page count, running the
plan's byte runs (P shard -> piece -> D shard, and the zero fills) writes every byte of every D shard's staging
exactly once, and D's staging then holds exactly what a pool split D's way holds: each slot its model head's bytes,
padding slots zeros. Bytes are labelled with where they come from, so a byte from the wrong head, layer, row or
token, or one written twice, cannot pass.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_pd.kernels.layout import PAD_HEAD, kv_slot_heads
from fsm_pd.transport.reshard import Fill, Piece, byte_runs, piece_uuid, plan_between, plan_reshard


def shard_stagings(labels: np.ndarray, slot_heads: tuple[int, ...], tp: int) -> list[np.ndarray]:
    """Each shard's staging bytes, ``[L * rows * page_size, shard slots * slot bytes]``, from the labelled model heads
    ``labels: [L * rows * page_size, kv_heads, slot bytes]``; padding slots hold 0."""
    tokens, _, slot_bytes = labels.shape
    whole = np.zeros((tokens, len(slot_heads), slot_bytes), labels.dtype)
    for slot, head in enumerate(slot_heads):
        if head != PAD_HEAD:
            whole[:, slot] = labels[:, head]
    return [part.reshape(tokens, -1) for part in np.split(whole, tp, axis=1)]


def indices(run) -> np.ndarray:
    return (run.offset + np.arange(run.repeat)[:, None] * run.stride + np.arange(run.length)[None, :]).reshape(-1)


def run_plan(kv_heads, head_dim, itemsize, page_size, rows, num_layers, src_tp, dst_tp):
    """Apply the plan to labelled P shards; returns D's shards, how often each byte was written, what they should
    hold, and the plan."""
    slot_bytes = 2 * head_dim * itemsize
    tokens = num_layers * rows * page_size
    labels = np.arange(1, tokens * kv_heads * slot_bytes + 1, dtype=np.int64).reshape(tokens, kv_heads, slot_bytes)
    src = [s.reshape(-1) for s in shard_stagings(labels, kv_slot_heads(kv_heads, src_tp), src_tp)]
    want = [s.reshape(-1) for s in shard_stagings(labels, kv_slot_heads(kv_heads, dst_tp), dst_tp)]
    dst = [np.full_like(w, -1) for w in want]
    writes = [np.zeros(w.shape, np.int64) for w in want]
    plan = plan_reshard(kv_heads, src_tp, dst_tp)
    sizes = dict(num_layers=num_layers, rows=rows, page_size=page_size, head_dim=head_dim, itemsize=itemsize)
    for part in (*plan.pieces, *plan.fills):
        runs = byte_runs(plan, part, **sizes)
        at = indices(runs["dst"])
        if isinstance(part, Piece):
            wire = np.zeros(runs["wire"].length * runs["wire"].repeat, np.int64)  # the piece's own array
            wire[indices(runs["wire"])] = src[part.src][indices(runs["src"])]
            dst[part.dst][at] = wire[indices(runs["wire"])]
        else:
            dst[part.dst][at] = 0
        np.add.at(writes[part.dst], at, 1)
    return dst, writes, want, plan


@settings(max_examples=300, deadline=None)
@given(kv_heads=st.integers(1, 9), head_dim=st.integers(1, 4), itemsize=st.sampled_from([1, 2, 4]),
       page_size=st.integers(1, 4), rows=st.integers(1, 4), num_layers=st.integers(1, 3),
       src_tp=st.integers(1, 8), dst_tp=st.integers(1, 8))
def test_the_plan_writes_every_byte_of_d_once_from_the_right_source(kv_heads, head_dim, itemsize, page_size, rows,
                                                                   num_layers, src_tp, dst_tp):
    dst, writes, want, plan = run_plan(kv_heads, head_dim, itemsize, page_size, rows, num_layers, src_tp, dst_tp)
    for shard, (got, count, expected) in enumerate(zip(dst, writes, want, strict=True)):
        assert (count == 1).all(), f"D shard {shard}: bytes written {sorted(set(count.tolist()))} times"
        np.testing.assert_array_equal(got, expected, err_msg=f"D shard {shard} holds other bytes than a "
                                                             f"{dst_tp}-way pool")
    # a piece never reads past its P shard, and pieces are numbered in order
    assert [p.index for p in plan.pieces] == list(range(len(plan.pieces)))
    assert all(p.src_slot + p.count <= plan.src_shard_slots for p in plan.pieces)


@pytest.mark.parametrize("kv_heads, src_tp, dst_tp, pieces, fills", [
    # one device each side: the whole staging, one piece
    (4, 1, 1, [(0, 0, 0, 0, 4)], []),
    # KV heads >= TP: 1 -> 2 cuts P's one shard in two; 2 -> 1 joins two whole shards
    (4, 1, 2, [(0, 0, 0, 0, 2), (0, 2, 1, 0, 2)], []),
    (4, 2, 1, [(0, 0, 0, 0, 2), (1, 0, 0, 2, 2)], []),
    (4, 4, 4, [(i, 0, i, 0, 1) for i in range(4)], []),
    # KV heads < TP (tiny's 2 heads): D copies each head twice; P's copies are spread over D's shards
    (2, 2, 4, [(0, 0, 0, 0, 1), (0, 0, 1, 0, 1), (1, 0, 2, 0, 1), (1, 0, 3, 0, 1)], []),
    (2, 4, 1, [(0, 0, 0, 0, 1), (2, 0, 0, 1, 1)], []),
    (2, 4, 2, [(0, 0, 0, 0, 1), (3, 0, 1, 0, 1)], []),
    # SmolLM2's 3 KV heads: 2 devices pad to 4 slots; the padding slot is filled, never pulled
    (3, 1, 2, [(0, 0, 0, 0, 2), (0, 2, 1, 0, 1)], [(1, 1, 1)]),
    (3, 2, 1, [(0, 0, 0, 0, 2), (1, 0, 0, 2, 1)], []),
    (3, 2, 3, [(0, 0, 0, 0, 1), (0, 1, 1, 0, 1), (1, 0, 2, 0, 1)], []),
])
def test_plans_for_the_usual_splits(kv_heads, src_tp, dst_tp, pieces, fills):
    plan = plan_reshard(kv_heads, src_tp, dst_tp)
    assert [(p.src, p.src_slot, p.dst, p.dst_slot, p.count) for p in plan.pieces] == pieces
    assert [(f.dst, f.dst_slot, f.count) for f in plan.fills] == fills
    assert plan.unsharded == (src_tp == dst_tp == 1)


def test_plan_between_reads_layout_records_and_refuses_other_models():
    one = {"kv_heads": 4, "num_layers": 2}
    assert plan_between(one, {**one, "tp": 2}) == plan_reshard(4, 1, 2)  # a record without tp is one device's
    with pytest.raises(ValueError, match="KV heads"):
        plan_between(one, {"kv_heads": 2, "tp": 2})


def test_kv_slot_heads_pads_then_copies():
    assert kv_slot_heads(4, 2) == (0, 1, 2, 3)
    assert kv_slot_heads(2, 4) == (0, 0, 1, 1)
    assert kv_slot_heads(3, 2) == (0, 1, 2, PAD_HEAD)
    assert kv_slot_heads(3, 3) == (0, 1, 2)
    assert kv_slot_heads(3, 8) == (0, 0, 1, 1, 2, 2, PAD_HEAD, PAD_HEAD)
    assert kv_slot_heads(1, 4) == (0, 0, 0, 0)


@given(uuid=st.integers(1, (1 << 63) - 1), index=st.integers(0, 64))
def test_piece_uuids_stay_valid_and_distinct(uuid, index):
    assert piece_uuid(uuid, 0) == uuid
    assert 1 <= piece_uuid(uuid, index) < 1 << 63
    assert piece_uuid(uuid, index) != piece_uuid(uuid, index + 1)


def test_fill_and_piece_describe_themselves():
    assert Piece(2, 1, 0, 3, 0, 1).describe() == "piece 2 (prefill shard 1 -> decode shard 3)"
    assert Fill(1, 1, 1).count == 1
