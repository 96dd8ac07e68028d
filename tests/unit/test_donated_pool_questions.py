"""What other threads ask of the pool is answered from its placement, never from its arrays: all through a forward
pass, ``owner.pool`` names the arrays the pass donated (``serving/forward.py`` reassigns it when the pass returns).
The node loop and the pull workers ask ``JaxKV`` (``summed``: may P checksum a handoff; ``stream_layers``: may D
write a pull as it lands; a piece's pull spec), the start-up thread ``resolve_impl`` (``warmup.compile_rest``, once
the node takes requests). A chunked handoff's ``GatherAndPublish`` asked ``summed`` on the loop meanwhile, and failed
its room with "Array has been deleted" (``test_chunk_transfers.py``, about one run in three)."""

from __future__ import annotations

import threading
from functools import partial

import jax
import numpy as np
import pytest

from fsm_pd.control.jax_kv import JaxKV
from fsm_pd.kernels import KVLayout, resolve_impl
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.transport.reshard import Piece

# what only a CPU does (the pool's sums, layer-streamed writes): the CPU is jax's default device (tests/on_chip.py)
pytestmark = pytest.mark.usefixtures("cpu_default")

LAYOUT = KVLayout(num_layers=2, num_pages=8, page_size=4, kv_heads=2, head_dim=8)


@partial(jax.jit, donate_argnums=0)
def forward(pool):  # a forward pass as far as the pool goes: it donates the pool and returns the next one
    return tuple(layer + 1 for layer in pool)


def test_the_pool_questions_asked_off_the_model_thread_are_answered_while_a_forward_pass_donated_it():
    owner = ModelThread(tuple(jax.device_put(np.zeros(LAYOUT.layer_shape, np.float32)) for _ in range(2)))
    mid_pass, passed = threading.Event(), threading.Event()

    def forward_pass(owner):  # as serving/forward.py runs one
        out = forward(owner.pool)
        mid_pass.set()  # owner.pool: the donated arrays, until this job reassigns it
        passed.wait(10)
        owner.pool = out

    try:
        # each question on a fresh JaxKV: one that asked before the pass would answer from what it learned then
        kvs = [JaxKV(LAYOUT, owner, progressive=True) for _ in range(3)]
        done = owner.submit(forward_pass)
        assert mid_pass.wait(10)
        assert owner.pool[0].is_deleted()  # the window the node loop asked in
        try:
            assert kvs[0].summed  # a pool on the CPU: P checksums the handoff
            assert kvs[1].stream_layers  # one CPU device: D writes the layers as they land
            half = Piece(index=0, src=0, src_slot=0, dst=0, dst_slot=0, count=LAYOUT.slots // 2)
            (spec,) = kvs[2].pull_spec(3, half)
            assert spec.sharding.device_set == {jax.devices("cpu")[0]}
            assert resolve_impl(owner.pool) == "cpu"
        finally:
            passed.set()
        done.result(10)
        assert not owner.pool[0].is_deleted()
    finally:
        owner.close()
