"""KV staging bytes between a device and the host as 32-bit words, 128 to a row: the layout a TPU copies fastest.

A TPU keeps a bfloat16 array in tiles whose 32-bit words pair values of two rows, so its copy to the host comes out
in the device's order and is put back in row-major order on the way (and the reverse on the way in). An array of
``uint32[n, 128]`` lies in tiles of 8 whole rows of 128 words, which in row-major order are the bytes as they stand.
On the TPU v5e (round r10, 90 MiB of SmolLM2's KV, ``bench/host_copy.py``) the copies as served, conversions
included, reached the host at 0.50 GB/s against 0.32 and the device at 7.4 GB/s against 5.3 (before ``same_bits``,
below). ``FSM_PD_HOST_WORDS=off`` turns them off; a program that fails (out of device memory, say) falls back to the
plain copy. The words hold the array's row-major bytes exactly, so the bytes on the wire are unchanged: a node that
copies words talks to one that does not, either way round.

How the words are made matters as much. The obvious way, a bitcast of ``bfloat16[n, 2]`` to ``uint32[n]``, puts a
dimension of 2 in the TPU's 128 lanes: for those 90 MiB XLA planned a 12 GB temporary and touched 25 GB (libtpu's
own plan for a described v5e; the chip took 36.6 ms). Here each 16-bit half is picked out by a strided slice and
shifted into its place (XLA's plan: 0.75 GB touched, one array's worth of temporary), and the way back lays the two
halves side by side along the rows of the transposed words (1.1 GB, one array's worth).

Every bit must survive, NaN payloads included, and on a TPU XLA cannot reinterpret a ``bfloat16`` array as integers
for free: its bitcast-convert is an op of its own there, which turned signalling NaNs into the quiet 0x7FC0 on the
chip (round r10: the 16-bit cases of ``tests/unit/test_host_words.py``, random bits). So on a TPU the bits of a
16-bit array change type by one DMA from HBM to HBM (``same_bits``, a Pallas kernel: a DMA moves bytes and reads
none as a number), and every other op of both programs works on unsigned integers; libtpu's plan for a described
v5e shows no other op that reads or writes the float type (``bench/words_plan.py``, checked by
``tests/unit/test_words_plan.py``). The DMA costs a read and a write of the array in HBM, a fraction of a
millisecond for 90 MiB against the copy to the host's 180 ms. 32-bit floats keep XLA's bitcast, exact on the chip.

Each direction is one program per staging shape, dtype and device, compiled ahead (``prepare``; a node's background
compile prepares every page bucket of its handoffs, ``serving/warmup.py``) and never on a request's path: until an
array's program is there, it is copied the plain way. ``pays_on`` says where preparing is worth it: one device that
is not a CPU. On a CPU, NumPy reads a device array in place and ``device_put`` aliases an aligned host array, so
words would only add a copy. Only arrays of whole 512-byte rows (``fits``) are copied as words.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

log = logging.getLogger(__name__)

ENV = "FSM_PD_HOST_WORDS"  # "off": every copy the plain way (nothing is prepared); a chip round compares both
LANES = 128  # a TPU tile's width: 128 words of 32 bits
ROW_BYTES = 4 * LANES
_UNSIGNED = {2: jnp.uint16, 4: jnp.uint32}  # the element widths a word holds whole: two halves, or one

# (shape, dtype name, device) -> the compiled program of each direction
_down: dict[tuple, jax.stages.Compiled] = {}
_up: dict[tuple, jax.stages.Compiled] = {}
# copies made each way: "down_words", "down_plain", "up_words", "up_plain", and "down_fallback", "up_fallback" for
# a words program that failed (what tests and benches read); counted from the model thread and the pull threads
copies: Counter[str] = Counter()
_counting = threading.Lock()
_told_fallback = threading.Event()


def enabled() -> bool:
    """Whether programs are prepared at all (``FSM_PD_HOST_WORDS=off``: never, so every copy goes the plain way)."""
    return os.environ.get(ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def _count(kind: str) -> None:
    with _counting:
        copies[kind] += 1


def _fell_back(kind: str, exc: Exception) -> None:
    """A words program failed (out of device memory beside a full pool, say): this copy goes the plain way, which
    needs no second array on the device; said once a process, counted every time."""
    _count(kind)
    if not _told_fallback.is_set():
        _told_fallback.set()
        log.warning("host copy as words failed (%s: %s); copying the plain way", type(exc).__name__, exc)


def fits(shape: Sequence[int], dtype: Any) -> bool:
    """Whether an array of ``shape`` and ``dtype`` is whole rows of 128 words of 16- or 32-bit elements (on a
    little-endian host: a word's low half is then the first of its two elements), in 2 dimensions or more and not
    ``float16``: on a TPU ``same_bits`` keeps a 16-bit array's bits by a Pallas kernel, which takes no 1-D array
    and no ``float16`` there."""
    itemsize = np.dtype(dtype).itemsize
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    return (sys.byteorder == "little" and itemsize in _UNSIGNED and np.dtype(dtype) != np.float16
            and len(shape) >= 2 and nbytes > 0 and nbytes % ROW_BYTES == 0)


def pays_on(sharding: Any) -> bool:
    """Whether arrays placed by ``sharding`` are worth preparing programs for: one accelerator device."""
    return _device(sharding) is not None and _device(sharding).platform != "cpu"


def _copy_bytes(source, target, done) -> None:
    # the target seen as the source's dtype: a DMA moves bytes, and nothing on the way reads them as numbers
    from jax.experimental.pallas import tpu as pltpu

    copy = pltpu.make_async_copy(source, target.bitcast(source.dtype), done)
    copy.start()
    copy.wait()


def _bytes_as_dma(x: jax.Array, dtype: Any) -> jax.Array:
    """``x``'s bytes in a new array of ``dtype`` (as wide), by one DMA from HBM to HBM."""
    # Pallas loads here, when a program is traced: a node's start imports this module but must not load Pallas
    # (tests/unit/test_startup_imports.py)
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(_copy_bytes, out_shape=jax.ShapeDtypeStruct(x.shape, dtype), in_specs=[anywhere],
                          out_specs=anywhere, scratch_shapes=[pltpu.SemaphoreType.DMA(())])(x)


def same_bits(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` reinterpreted as ``dtype`` of the same width, every bit kept (traced). On a TPU a 16-bit array's bits
    are copied by a DMA: XLA's bitcast-convert of ``bfloat16`` is an op of its own there, which quiets NaN payloads
    (the chip, round r10); elsewhere, and for 32-bit elements (exact on the chip too), XLA's bitcast."""
    dtype = jnp.dtype(dtype)
    if x.dtype == dtype:
        return x
    bitcast = partial(jax.lax.bitcast_convert_type, new_dtype=dtype)
    if x.dtype.itemsize != 2:
        return bitcast(x)
    return jax.lax.platform_dependent(x, tpu=partial(_bytes_as_dma, dtype=dtype), default=bitcast)


def to_words(x: jax.Array) -> jax.Array:
    """``x``'s row-major bytes as ``uint32[n, 128]`` (traced: call it inside ``jax.jit``, or through ``prepare``)."""
    unsigned = same_bits(x, _UNSIGNED[x.dtype.itemsize])
    if x.dtype.itemsize == 4:
        return unsigned.reshape(-1, LANES)
    pairs = unsigned.reshape(-1, 2 * LANES)
    low, high = pairs[:, 0::2].astype(jnp.uint32), pairs[:, 1::2].astype(jnp.uint32)
    return low | (high << 16)


def from_words(words: jax.Array, shape: Sequence[int], dtype: Any) -> jax.Array:
    """The array of ``shape`` and ``dtype`` whose row-major bytes are ``words`` (traced, as ``to_words``)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 4:
        return same_bits(words.reshape(shape), dtype)
    low, high = (words & 0xFFFF).astype(jnp.uint16).T, (words >> 16).astype(jnp.uint16).T
    # row 2k + h of the stacked [128, 2, n] is half h of word column k: transposed back, the halves side by side
    pairs = jnp.stack([low, high], axis=1).reshape(2 * LANES, -1).T
    # every move above and the reshape are of integers; only the last step sees the dtype
    return same_bits(pairs.reshape(shape), dtype)


def prepare(shape: Sequence[int], dtype: Any, sharding: Any, *, down: bool = True, up: bool = True) -> bool:
    """Compile, ahead and from shapes alone (any thread may call it), the programs that copy arrays of ``shape`` and
    ``dtype`` on ``sharding``'s one device to the host as words (``down``) and back (``up``); from then on
    ``HostCopy`` and ``to_device`` use them. False, compiling nothing, where the array does not fit or the sharding
    is not one device."""
    key = _key(shape, dtype, sharding)
    if key is None or not enabled():
        return False
    placed = SingleDeviceSharding(key[2])
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize // ROW_BYTES
    if down and key not in _down:
        _down[key] = jax.jit(to_words).lower(jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=placed)).compile()
    if up and key not in _up:
        unpack = jax.jit(from_words, static_argnums=(1, 2))
        _up[key] = unpack.lower(jax.ShapeDtypeStruct((n, LANES), jnp.uint32, sharding=placed), tuple(shape),
                                jnp.dtype(dtype)).compile()
    return True


def is_prepared(shape: Sequence[int], dtype: Any, sharding: Any, *, down: bool = True, up: bool = True) -> bool:
    key = _key(shape, dtype, sharding)
    return key is not None and (not down or key in _down) and (not up or key in _up)


def forget() -> None:
    """Drop every prepared program (tests: back to the plain way)."""
    _down.clear()
    _up.clear()


class HostCopy:
    """One device array's copy to the host, started at once (as words where its program is prepared), read once."""

    def __init__(self, array: jax.Array) -> None:
        self.shape, self.dtype, self.nbytes = tuple(array.shape), np.dtype(array.dtype), int(array.nbytes)
        program = _down.get(_key(array.shape, array.dtype, array.sharding))
        self._device: jax.Array | None = array
        if program is not None:
            try:
                self._device = program(array)
            except Exception as exc:  # noqa: BLE001 - the plain copy of the same array still works
                _fell_back("down_fallback", exc)
                program = None
        self.words = program is not None
        _count("down_words" if self.words else "down_plain")
        self._device.copy_to_host_async()  # the copy runs while the caller does other things
        self._host: np.ndarray | None = None
        self._lock = threading.Lock()

    def result(self) -> np.ndarray:
        """The array on the host, row-major, in its own shape and dtype (waits for the copy); the device array is let
        go once it is there."""
        with self._lock:
            if self._host is None:
                # row-major whatever order the runtime hands it in (a v5e gave some arrays column-major: converted.py)
                host = np.ascontiguousarray(np.asarray(self._device))
                self._host = host.view(self.dtype).reshape(self.shape) if self.words else host
                self._device = None
            return self._host


def to_device(host: np.ndarray, sharding: Any) -> jax.Array:
    """``host`` (a C-contiguous array) placed by ``sharding``: its bytes go up as words where the program is
    prepared, and the device turns them back into ``host``'s shape and dtype."""
    program = _up.get(_key(host.shape, host.dtype, sharding))
    if program is not None:
        words = host.reshape(-1).view(np.uint32).reshape(-1, LANES)
        try:
            placed = program(jax.device_put(words, SingleDeviceSharding(_device(sharding))))
        except Exception as exc:  # noqa: BLE001 - the plain copy of the same bytes still works
            _fell_back("up_fallback", exc)
        else:
            _count("up_words")
            return placed
    _count("up_plain")
    return jax.device_put(host, sharding)


def _device(sharding: Any):
    """The one device of a single-device sharding in device memory, else None."""
    if not isinstance(sharding, SingleDeviceSharding) or sharding.memory_kind not in (None, "device"):
        return None
    return next(iter(sharding.device_set))


def _key(shape: Sequence[int], dtype: Any, sharding: Any) -> tuple | None:
    device = _device(sharding)
    if device is None or not fits(shape, dtype):
        return None
    return tuple(shape), np.dtype(dtype).name, device
