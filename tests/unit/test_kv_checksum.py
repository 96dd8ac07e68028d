"""The KV checksum's values (``kernels/kv_checksum.py``): the same bytes give the same value whatever the pool's
split, in the order P and D share; a changed byte changes exactly its piece and layer; a streamed write's sums are
used only while nothing else ran on the model thread (``control/overlap.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import crc32c
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsm_pd.control.overlap import StreamedScatter
from fsm_pd.effects.checksums import mismatch, read_trailer, trailer_words
from fsm_pd.kernels import KVLayout, page_bucket
from fsm_pd.kernels.kv_checksum import SendSums, pool_checksums
from fsm_pd.kernels.page_source import PoolPages
from fsm_pd.model.model_thread import ModelThread

# what only a CPU does (checksums read from host memory, zero-copy views of the pool): the CPU is jax's default
# device here, on a TPU host too (tests/on_chip.py)
pytestmark = pytest.mark.usefixtures("cpu_default")


def layout(tp: int = 1, heads: int = 4) -> KVLayout:
    return KVLayout(num_layers=4, num_pages=12, page_size=4, kv_heads=heads, head_dim=8,
                    shard_axis="tp" if tp > 1 else None, tp=tp)


def pool_of(lay: KVLayout, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    return tuple(jax.device_put(rng.standard_normal(lay.layer_shape, dtype=np.float32)) for _ in range(lay.num_layers))


def test_whole_pages_are_the_crc32c_of_their_bytes_in_transfer_order():
    lay = layout()
    pool, pages = pool_of(lay), [7, 2, 3, 9]  # a run (2, 3) and single pages, out of order
    want = [crc32c.crc32c(b"".join(np.asarray(layer)[p].tobytes() for p in pages)) for layer in pool]
    assert pool_checksums(pool, pages, [(0, 0, lay.slots)], lay.head_dim) == [want]


def test_a_run_of_slots_is_each_pages_slice_row_major():
    lay = layout()
    pool, pages = pool_of(lay), [5, 1]
    part = (0, 1, 2)  # slots 1 and 2: lanes 16..48 of axis 2 (each slot is K and V, 8 values each)
    want = [crc32c.crc32c(b"".join(np.ascontiguousarray(np.asarray(layer)[p, :, 16:48]).tobytes() for p in pages))
            for layer in pool]
    assert pool_checksums(pool, pages, [part], lay.head_dim) == [want]


def test_a_changed_byte_names_its_piece_and_layer():
    lay = layout()
    pool, pages = pool_of(lay), [3, 4, 8]
    parts = [(0, 0, 2), (0, 2, 2)]
    before = pool_checksums(pool, pages, parts, lay.head_dim)
    host = np.array(pool[2])
    host.reshape(-1).view(np.uint8)[host[0].nbytes * 8 + 2 * 8 * 4 * 3 + 1] ^= 0x10  # page 8, a slot-3 row (piece 1)
    after = pool_checksums((*pool[:2], jax.device_put(host), *pool[3:]), pages, parts, lay.head_dim)
    assert after[0] == before[0] and after[1][2] != before[1][2] and after[1][:2] == before[1][:2]
    assert mismatch(before, after).startswith("kv checksum mismatch: piece 1 layer 2: ")
    assert mismatch(before, before) is None


def test_trailer_words_round_trip_as_int32():
    sums = [[0, 1, 0xFFFFFFFF], [0x80000000, 5, 6]]
    words = trailer_words(17, sums, 3)
    assert all(-(1 << 31) <= w < 1 << 31 for w in words)
    assert read_trailer(np.asarray(words, dtype=np.int32).tolist(), 3) == (17, sums)
    assert read_trailer(trailer_words(17, [None, None], 3), 3) == (17, None)  # P's pool not checksummed
    assert read_trailer(trailer_words(17, None, 3), 3) == (17, None)


@pytest.fixture
def model():
    owner = ModelThread(pool_of(layout(), seed=1), name="test-checksum-model")
    yield owner
    owner.close()


def streamed(model, pages, staging, foreign=False):
    lay = layout()
    stream = StreamedScatter(model, lay, pages, group=2, checksum=True)
    host = np.asarray(staging)
    stream.on_progress(0, host, host.nbytes // 2)  # the first group lands
    if foreign:  # another job between our writes: it could have written our pages
        model.submit(lambda owner: None)
    stream.on_progress(0, host, host.nbytes)

    def final(owner):
        stream.written(owner)
        return stream.checksums(owner), pool_checksums(owner.pool, pages, [(0, 0, lay.slots)], lay.head_dim)

    return model.call(final)


def test_a_streamed_write_checksums_each_group_as_it_writes_it(model):
    lay, pages = layout(), [4, 6, 1]
    staging = np.random.default_rng(3).standard_normal(lay.staging_shape(page_bucket(len(pages))), dtype=np.float32)
    taken, read_now = streamed(model, pages, staging)
    assert taken == read_now  # the sums taken while writing are the pages' sums
    taken, read_now = streamed(model, pages, staging, foreign=True)
    assert taken is None  # another job ran: the caller must read the pages again


def test_a_send_from_the_pool_sums_what_it_sends_and_the_next_job_the_rest_before_it_writes(model):
    """``SendSums``: the values of ``pool_checksums`` (padding rows left out), whatever slices the send takes; the
    next job's start sums what the send had not reached, before the job changes a page (a page reused mid-send)."""
    lay, pages = layout(), [4, 6, 1]  # 3 pages in a bucket of 4 rows: one padding row per layer
    source = PoolPages(model, pages, lay)
    got: list = []

    def publish(owner):  # as checksum_later: in the publishing job, the rest summed at the next job's start
        source.sums = SendSums(source, len(pages), got.append)
        owner.lease.before_next_job(source.sums.finish)
        return pool_checksums(owner.pool, pages, [(0, 0, lay.slots)], lay.head_dim)

    def reuse(owner):  # the next job writes another request's KV into the room's first page
        owner.pool = tuple(layer.at[pages[0]].set(7.0) for layer in owner.pool)

    want = model.call(publish)
    pos = 0
    with model.lease.read(model.lease.turn()):  # the send's turns, uneven slices across layers and padding rows
        for step in (100, source.layer_bytes, 3 * source.page_bytes + 5):
            deliver = source.sums.took(pos, pos + step)
            assert deliver is None and not got
            pos += step
    model.call(reuse)
    assert got == [want]  # summed before the reuse: D, which receives the reused page, finds a mismatch
    assert model.call(lambda owner: pool_checksums(owner.pool, pages, [(0, 0, lay.slots)], lay.head_dim)) != want

    source = PoolPages(model, pages, lay)  # a send that reaches the end delivers without waiting for a job
    want = model.call(publish)
    with model.lease.read(model.lease.turn()):
        deliver = source.sums.took(0, source.nbytes)
    assert deliver is not None and len(got) == 1
    deliver()
    assert got[1] == want
    model.call(lambda owner: None)  # its finish at the next job does nothing more
    assert len(got) == 2


TP_CHECK = """
import numpy as np, jax
from test_kv_checksum import layout, pool_of
from fsm_pd.kernels.kv_checksum import pool_checksums
from fsm_pd.transport.reshard import plan_reshard
from jax.sharding import Mesh, NamedSharding
assert len(jax.devices()) == 2
one, two = layout(1), layout(2)
pool = pool_of(one)  # the same logical KV on P (split over 2 devices) and on D (one device)
mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
split = tuple(jax.device_put(layer, NamedSharding(mesh, two.pool_spec())) for layer in pool)
plan, pages, parts = plan_reshard(4, 2, 1), [3, 9, 4], lambda plan, side: [side(p) for p in plan.pieces]
src, dst = (lambda p: (p.src, p.src_slot, p.count)), (lambda p: (p.dst, p.dst_slot, p.count))
for algorithm in ("crc32c", "kvmix32"):  # the host's crc and the device hash (kernels/kv_hash.py)
    sent = pool_checksums(split, pages, parts(plan, src), 8, algorithm)
    got = pool_checksums(pool, pages, parts(plan, dst), 8, algorithm)
    assert len(sent) == len(plan.pieces) == 2 and sent == got, (algorithm, sent, got)
    back = pool_checksums(split, pages, parts(plan_reshard(4, 1, 2), dst), 8, algorithm)
    assert back == pool_checksums(pool, pages, parts(plan_reshard(4, 1, 2), src), 8, algorithm), algorithm
print("tp ok")
"""


def test_split_pools_agree_piece_by_piece_across_a_reshard():
    """P split over 2 devices, D over 1 (and back): each piece's values are the same on both sides, crc32c and the
    device hash alike."""
    from xla_flags import with_host_devices  # here: the child imports this module, without the tests' own path

    env = {**os.environ, "XLA_FLAGS": with_host_devices(2), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", TP_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "tp ok" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]



def test_checksum_later_sees_the_pages_as_the_publishing_job_left_them(model):
    """P's checksum of a handoff sent from the pool is read on a helper thread after the publishing job, while the
    data streams: the lease turn that job reserves keeps the next job (a page reused) waiting until it has read."""
    from concurrent.futures import Future

    from fsm_pd.control.jax_kv import JaxKV, _checksum_worker
    from fsm_pd.transport.reshard import plan_between

    lay, pages = layout(), [2, 5]
    kv, plan, got = JaxKV(lay, model, progressive=True), plan_between(lay.to_dict(), lay.to_dict()), Future()
    _checksum_worker().submit(threading.Event().wait, 0.3)  # the helper is busy: the next job comes first in line

    def publish_job(owner):
        kv.checksum_later(owner, pages, plan, got.set_result)
        return kv.sent_checksum(owner, pages, plan)

    def reuse(owner):  # the next job writes another request's KV into the page
        owner.pool = (jax.device_put(np.zeros(lay.layer_shape, np.float32)), *owner.pool[1:])

    want = model.submit(publish_job)
    model.submit(reuse)
    assert got.result(10) == want.result(10)
    assert model.call(lambda owner: kv.sent_checksum(owner, pages, plan)) != want.result()  # the reuse did land


def test_corrupt_pull_flips_one_byte_of_an_entry_once():
    from fsm_pd.effects.faults import FaultConfig, Faults

    config = FaultConfig.from_env({"FSM_PD_FAULT_CORRUPT_PULL": "1"})
    assert config.corrupt_pull == 1.0 and config.enabled and config.describe() == {"corrupt_pull": 1.0}
    with pytest.raises(ValueError, match="CORRUPT_PULL"):
        FaultConfig.from_env({"FSM_PD_FAULT_CORRUPT_PULL": "2"})
    faults = Faults(config, role="decode")
    # a stream writes the bytes as they land: flipped there, once, before the stream sees them
    seen = []
    corruption = faults.corrupting()
    hook = corruption.hook(lambda index, host, n: seen.append(n))
    host = np.zeros(8, np.float32)
    hook(0, host, 4)
    hook(0, host, 32)
    assert seen == [4, 32] and np.count_nonzero(host.view(np.uint8)) == 1 and host[0] != 0 and not host[1:].any()
    assert corruption.landed(host, pytest.fail) is host  # flipped as it landed: not again
    # no stream (any backend): the pulled array flipped where it lives, the same byte as the hook's
    from fsm_pd.control.jax_kv import JaxKV

    kv = JaxKV(layout(), None, progressive=False)
    for dtype, byte in ((np.float32, 2), (jnp.bfloat16, 0)):
        pulled = jax.device_put(np.zeros((2, 3, 4, 8), dtype))
        landed = np.asarray(faults.corrupting().landed(pulled, kv.corrupt))
        flat = landed.reshape(-1).view(np.uint8)
        assert landed.shape == pulled.shape and landed.dtype == pulled.dtype
        assert np.flatnonzero(flat).tolist() == [byte] and flat[byte] == 0xFF
    assert faults.counters()["corrupt_pull"] == 3
    assert Faults(FaultConfig(), role="decode").corrupting() is None  # off: no corruption
