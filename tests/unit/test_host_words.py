"""kernels/host_words.py: a staging array between the device and the host as ``uint32[n, 128]`` words carries exactly
the bytes of the plain copy, both ways, for 16- and 32-bit arrays of random bits that hold signalling and quiet NaNs
with payloads and subnormals (what the chip's bitcast-convert of bfloat16 changed, round r10); arrays that are not
whole 512-byte rows, 1-D or float16, and arrays with no prepared program, are copied the plain way; and a node's
background compile prepares the programs of its handoffs' page buckets only where they pay (one accelerator device, a
backend that streams host bytes). On a TPU host (``tests/on_tpu.sh``) these run on the chip, whose bfloat16 tiles are
what the words are for, and the 16-bit cases there run the DMA that keeps the bits (``host_words.same_bits``)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsm_pd.kernels import KVLayout, host_words
from fsm_pd.serving import warmup
from fsm_pd.serving.warmup_plan import WarmupPlan

pytestmark = pytest.mark.chip  # tests/on_tpu.sh: on the chip

DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # the default device: a TPU's on the chip
WHOLE_ROWS = [(2, 4, 16, 96), (3, 1, 16, 64), (1, 2, 8, 128), (2, 128)]  # staging shapes, and a row or two
NOT_WHOLE = [(7, 16, 33), (3, 5, 7)]  # 7,392 and 210 bytes in bfloat16, 14,784 and 420 in float32: not 512-byte rows


@pytest.fixture(autouse=True)
def _no_programs():
    host_words.forget()
    yield
    host_words.forget()


# bit patterns an op that reads floats may change (the chip's bitcast-convert of bfloat16 made the signalling NaN
# 0x7FBF the quiet 0x7FC0, round r10): signalling and quiet NaNs with payloads, both signs, subnormals, -0, infinity
SPECIAL = {2: [0x7FBF, 0xFFAE, 0x7F81, 0x7FC1, 0xFFFF, 0x0001, 0x8001, 0x007F, 0x8000, 0x7F80],
           4: [0x7F800001, 0xFFBFFFFF, 0x7FC00001, 0x00000001, 0x807FFFFF, 0x80000000, 0xFF800000]}


def any_bits(shape, dtype, seed: int = 0) -> np.ndarray:
    """A host array of random bit patterns, the special ones above first (every array holds each of them, whatever
    its size and seed): compare bytes."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    bits = np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8).view(f"u{dtype.itemsize}").copy()
    special = SPECIAL[dtype.itemsize]
    bits[:len(special)] = special
    return bits.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", WHOLE_ROWS)
def test_words_hold_the_row_major_bytes_of_the_array_both_ways(shape, dtype):
    host = any_bits(shape, dtype)
    array = jax.device_put(host, DEVICE)
    words = jax.jit(host_words.to_words)(array)
    assert words.dtype == jnp.uint32 and words.shape == (host.nbytes // host_words.ROW_BYTES, host_words.LANES)
    assert np.asarray(words).tobytes() == host.tobytes()
    back = jax.jit(host_words.from_words, static_argnums=(1, 2))(words, shape, dtype)
    assert back.dtype == dtype and back.shape == shape and np.asarray(back).tobytes() == host.tobytes()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", WHOLE_ROWS)
def test_a_prepared_array_goes_down_and_up_as_words_with_the_plain_copys_bytes(shape, dtype):
    host = any_bits(shape, dtype, seed=1)
    plain_down = host_words.HostCopy(jax.device_put(host, DEVICE))
    plain_up = host_words.to_device(host, DEVICE)
    assert not plain_down.words
    assert host_words.fits(shape, dtype) and host_words.prepare(shape, dtype, DEVICE)
    assert host_words.is_prepared(shape, dtype, DEVICE)
    before = Counter(host_words.copies)
    down = host_words.HostCopy(jax.device_put(host, DEVICE))
    up = host_words.to_device(host, DEVICE)
    assert Counter(host_words.copies) - before == {"down_words": 1, "up_words": 1}
    got = down.result()
    assert down.words and got.dtype == host.dtype and got.shape == host.shape and got.flags.c_contiguous
    assert got.tobytes() == plain_down.result().tobytes() == host.tobytes()
    assert up.dtype == dtype and up.shape == shape and up.sharding == DEVICE and up.committed
    assert np.asarray(up).tobytes() == np.asarray(plain_up).tobytes() == host.tobytes()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", NOT_WHOLE)
def test_an_array_of_partial_rows_is_never_words_and_is_copied_plainly(shape, dtype):
    host = any_bits(shape, dtype, seed=2)
    assert not host_words.fits(shape, dtype)
    assert not host_words.prepare(shape, dtype, DEVICE) and not host_words.is_prepared(shape, dtype, DEVICE)
    before = Counter(host_words.copies)
    down = host_words.HostCopy(jax.device_put(host, DEVICE))
    up = host_words.to_device(host, DEVICE)
    assert Counter(host_words.copies) - before == {"down_plain": 1, "up_plain": 1}
    assert down.result().tobytes() == host.tobytes() and np.asarray(up).tobytes() == host.tobytes()


def test_only_16_and_32_bit_arrays_on_one_device_memory_get_programs():
    assert not host_words.fits((2, 256), jnp.int8) and host_words.fits((2, 128), jnp.bfloat16)
    assert not host_words.fits((0, 128), jnp.float32)
    # one dimension, or float16: a TPU could not keep a 16-bit array's bits (Pallas takes neither there)
    assert not host_words.fits((256,), jnp.bfloat16) and not host_words.fits((128,), jnp.float32)
    assert not host_words.fits((2, 128), jnp.float16) and host_words.fits((2, 128), jnp.uint16)
    assert not host_words.prepare((2, 128), jnp.bfloat16, None)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    assert not host_words.prepare((2, 128), jnp.bfloat16, replicated)
    assert not host_words.is_prepared((2, 128), jnp.bfloat16, DEVICE)


def test_a_direction_is_prepared_alone_and_the_other_stays_plain():
    shape, dtype = (2, 4, 16, 96), jnp.bfloat16
    host = any_bits(shape, dtype, seed=3)
    assert host_words.prepare(shape, dtype, DEVICE, down=True, up=False)
    assert host_words.is_prepared(shape, dtype, DEVICE, up=False)
    assert not host_words.is_prepared(shape, dtype, DEVICE)
    assert host_words.HostCopy(jax.device_put(host, DEVICE)).words
    before = Counter(host_words.copies)
    host_words.to_device(host, DEVICE)
    assert Counter(host_words.copies) - before == {"up_plain": 1}


def test_words_pay_on_one_accelerator_device_only():
    """On a CPU, NumPy reads a device array in place and device_put aliases the host array: words only add a copy."""
    assert host_words.pays_on(DEVICE) == (jax.devices()[0].platform != "cpu")
    assert not host_words.pays_on(jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]))
    assert not host_words.pays_on(None)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    assert not host_words.pays_on(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_background_compile_prepares_a_handoffs_copies_where_they_pay(monkeypatch, role):
    layout = KVLayout(num_layers=2, num_pages=64, page_size=16, kv_heads=2, head_dim=16, dtype="bfloat16")
    buckets = [1, 2, 8]
    plan = WarmupPlan([], [1], gather_buckets=buckets if role == "prefill" else [],
                      scatter_buckets=buckets if role == "decode" else [])
    pool = [jax.ShapeDtypeStruct(layout.layer_shape, jnp.bfloat16, sharding=DEVICE)] * layout.num_layers

    def engine(progressive: bool):
        return SimpleNamespace(layout=layout, manager=SimpleNamespace(backend=SimpleNamespace(progressive=progressive)))

    monkeypatch.setattr(host_words, "pays_on", lambda sharding: False)  # a CPU pool
    assert warmup.host_word_jobs(engine(True), plan, pool) == []
    monkeypatch.setattr(host_words, "pays_on", lambda sharding: sharding == DEVICE)  # a pool on one accelerator
    assert warmup.host_word_jobs(engine(False), plan, pool) == []  # jax, device, pool backends: no host copy
    jobs = warmup.host_word_jobs(engine(True), plan, pool)
    assert [kind for kind, *_ in jobs] == ["kernels"] * len(buckets)
    for _, _, there, make in jobs:
        assert not there()
        make()
        assert there()
    down = role == "prefill"
    for rows in buckets:
        shape = layout.staging_shape(rows)
        assert host_words.is_prepared(shape, "bfloat16", DEVICE, down=down, up=not down)
        assert not host_words.is_prepared(shape, "bfloat16", DEVICE, down=not down, up=down)


def test_a_jit_output_goes_down_as_words_with_its_bytes():
    """What a prefill node publishes is a program's output (the gather), not an array put there from the host."""
    shape, dtype = (2, 4, 16, 96), jnp.bfloat16
    host = any_bits(shape, dtype, seed=4)
    made = jax.jit(lambda x: x[::-1])(jax.device_put(host, DEVICE))
    # against the plain copy of the same output: XLA:CPU at the suite's cheap settings rewrites some NaN payloads in
    # a bfloat16 reversal, so the output's bytes need not be the host array's
    expected = np.asarray(made).tobytes()
    assert host_words.prepare(shape, dtype, DEVICE, up=False)
    copy = host_words.HostCopy(made)
    assert copy.words and copy.result().tobytes() == expected


def test_a_failing_words_program_falls_back_to_the_plain_copy_counted(caplog):
    shape, dtype = (3, 1, 16, 64), jnp.float32
    host = any_bits(shape, dtype, seed=5)
    assert host_words.prepare(shape, dtype, DEVICE)
    key = host_words._key(shape, dtype, DEVICE)

    def fails(*_):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (a test's)")

    host_words._down[key] = host_words._up[key] = fails
    before = Counter(host_words.copies)
    down = host_words.HostCopy(jax.device_put(host, DEVICE))
    up = host_words.to_device(host, DEVICE)
    assert Counter(host_words.copies) - before == {"down_fallback": 1, "down_plain": 1, "up_fallback": 1,
                                                   "up_plain": 1}
    assert not down.words and down.result().tobytes() == host.tobytes()
    assert np.asarray(up).tobytes() == host.tobytes() and up.sharding == DEVICE


def test_the_switch_off_prepares_nothing_and_the_background_compile_adds_no_job(monkeypatch):
    monkeypatch.setenv(host_words.ENV, "off")
    shape, dtype = (2, 4, 16, 96), jnp.bfloat16
    assert not host_words.prepare(shape, dtype, DEVICE) and not host_words.is_prepared(shape, dtype, DEVICE)
    layout = KVLayout(num_layers=2, num_pages=64, page_size=16, kv_heads=2, head_dim=16, dtype="bfloat16")
    pool = [jax.ShapeDtypeStruct(layout.layer_shape, jnp.bfloat16, sharding=DEVICE)] * layout.num_layers
    monkeypatch.setattr(host_words, "pays_on", lambda sharding: True)
    engine = SimpleNamespace(layout=layout, manager=SimpleNamespace(backend=SimpleNamespace(progressive=True)))
    assert warmup.host_word_jobs(engine, WarmupPlan([], [1], gather_buckets=[1, 2], scatter_buckets=[]), pool) == []
