"""``JaxKV``: the real ``PrefillKV`` and ``DecodeKV`` ports, the page kernels over the pool the model thread owns.

This is the only control-plane module the effect handlers reach jax through, which keeps jax out of the handlers
and out of the simulation that runs them.

Between different tensor-parallel sizes (``transport/reshard.py``): P gathers its pool into staging as usual (split
over its devices like the pool), then cuts each device's part into the plan's pieces, slots along axis 3, each on the
device that holds it. D pulls each piece onto the device of the decode shard it belongs to, joins each shard's pieces
and zero fills in slot order on that device, and writes the assembled staging (split over its devices like its pool)
with the usual scatter. Nothing moves between D's devices, and nothing is copied where a piece is a whole shard.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from fsm_pd.control.overlap import StreamedScatter, publish_while_gathering
from fsm_pd.effects.chunked import Trailer
from fsm_pd.kernels import KVLayout, gather_pages, page_bucket, resolve_impl, scatter_pages
from fsm_pd.kernels.kv_checksum import (
    ALGORITHM_ENV,
    CRC32C,
    SendSums,
    algorithm_for,
    layer_shards,
    pool_checksums,
)
from fsm_pd.kernels.page_source import PoolPages
from fsm_pd.kernels.placement import pool_placement
from fsm_pd.transport.reshard import Piece, ReshardPlan

log = logging.getLogger(__name__)


class JaxKV:
    on_model_thread = True  # every job copies KV in the pool (effects/ports.py, run_kv_job)

    def __init__(self, layout: KVLayout, model: Any, *, progressive: bool, sharding: Any = None,
                 checksum: bool = False):
        """``progressive``: the transfer backend streams host bytes, so copies may overlap the wire. ``checksum``:
        a decode node verifies the KV checksum, so a streamed write takes it as each group lands."""
        self.layout, self.model, self.sharding = layout, model, sharding
        self.progressive, self.checksum = progressive, checksum
        self._sending: tuple[list[int], PoolPages] | None = None  # the pages this job publishes from the pool
        self._pool_sharding: Any = None  # the pool's sharding, once the pool exists (see pool_sharding)
        self._algorithm: str | None = None  # checksum_algorithm, once the pool exists
        # what the node was started with (read now, as the fault knobs are; a bad name fails the start)
        self._asked = {ALGORITHM_ENV: os.environ.get(ALGORITHM_ENV, "")}
        algorithm_for(True, self._asked)

    # --- prefill ---
    def gather(self, owner: Any, pages: list[int], plan: ReshardPlan) -> tuple[jax.Array, ...]:
        staging = gather_pages(owner.pool, pages, layout=self.layout)
        staging.block_until_ready()
        if plan.unsharded:
            return (staging,)
        parts = device_parts(staging)
        cut = lambda p: _slots(parts[p.src], self.layout.slot_lanes(p.src_slot, p.count))  # noqa: E731
        pieces = tuple(parts[p.src] if plan.whole(p) else cut(p) for p in plan.pieces)
        jax.block_until_ready(pieces)
        return pieces

    def gathers_progressively(self, owner: Any) -> bool:
        return resolve_impl(owner.pool) == "cpu"

    @property
    def pool_sharding(self) -> Any:
        """The pool's sharding (every program that rewrites the pool keeps it), or None before there is a pool: what
        the node loop and the pull workers may learn of the pool (``summed``, ``stream_layers``, ``_devices``). Read
        from ``sharding`` and kept, never from the arrays' ``devices()`` or data: those raise once a forward pass
        donated them, and ``owner.pool`` names the donated arrays until the pass returns. A chunked handoff's
        ``GatherAndPublish`` that asked on the loop meanwhile failed its room with "Array has been deleted"."""
        if self._pool_sharding is None and (pool := self.model.pool) is not None:
            self._pool_sharding = pool[0].sharding
        return self._pool_sharding

    @property
    def summed(self) -> bool:
        """Any pool: crc32c reads one on CPU devices in place, the device hash runs where the pool is."""
        return self.checksum_algorithm is not None

    @property
    def checksum_algorithm(self) -> str | None:
        """The KV checksum this pool's values are (``kv_checksum.algorithm_for``; None before there is a pool): what
        P announces in READY, and what D compares P's values with only if they are of the same."""
        if self._algorithm is None and (sharding := self.pool_sharding) is not None:
            self._algorithm = algorithm_for(all(device.platform == "cpu" for device in sharding.device_set),
                                            self._asked)
        return self._algorithm

    def publish_while_gathering(self, owner: Any, transfer: Any, uuid: int, pages: list[int], hold_timeout_s: float,
                                on_published: Callable[[int], None]) -> None:
        """Where the backend can send from the pool's pages and the owner lends them between jobs (a model
        thread's ``lease``), nothing is gathered at all (``kernels/page_source.py``); else gather layer by layer
        into a staging block that is streamed as it fills."""
        if getattr(transfer, "sends_pages", False) and getattr(owner, "lease", None) is not None:
            source = PoolPages(owner, pages, self.layout)
            self._sending = (pages, source)  # for checksum_later, in this job: the send takes the sums
            transfer.publish_pages(uuid, source, hold_timeout_s)
            on_published(source.shape[1])
            return
        publish_while_gathering(transfer, uuid, owner.pool, pages, self.layout, hold_timeout_s, on_published)

    def trailer(self, words: list[int]) -> jax.Array:
        """A chunked handoff's trailer (``effects/chunked.py``): the first token (and the pieces' checksums), as
        ``int32[len(words)]``."""
        # device_put, not jnp.asarray: that one runs a small program per shape, compiled while serving
        return jax.device_put(np.asarray(words, dtype=np.int32).reshape(-1))

    def sent_checksum(self, owner: Any, pages: list[int], plan: ReshardPlan) -> list[list[int]] | None:
        return pool_checksums(owner.pool, pages, [(p.src, p.src_slot, p.count) for p in plan.pieces],
                              self.layout.head_dim, self.checksum_algorithm)

    def checksum_later(self, owner: Any, pages: list[int], plan: ReshardPlan,
                       done: Callable[[list[list[int]] | None], None]) -> None:
        """In the job that published ``pages``: their checksum as this job leaves them, taken while the send streams
        them, before any other job can change them. Sent straight from the pool (one piece of all slots): by the
        send itself as it reads the pages, and by the next job's start for what it has not reached
        (``kv_checksum.SendSums``); else on a helper thread under a lease turn reserved now (the next job waits for
        it). ``done(sums)`` from the send's thread, the model thread or the helper."""
        lease = getattr(owner, "lease", None)
        sending, self._sending = self._sending, None
        if lease is None or self.checksum_algorithm != CRC32C:  # the device hash: one pass at HBM speed, here
            done(self.sent_checksum(owner, pages, plan))
            return
        piece = plan.pieces[0]
        if (sending is not None and sending[0] is pages and len(plan.pieces) == 1 and piece.src_slot == 0
                and piece.count == self.layout.slots and len(layer_shards(owner.pool[0]) or ()) == 1):
            # sent from the pool: summed from the bytes as the send reads them, the rest by the next job's start
            source = sending[1]
            source.sums = SendSums(source, len(pages), done)
            lease.before_next_job(source.sums.finish)
            return
        turn = lease.reserve()

        def work() -> None:
            sums = None
            try:
                with lease.read(turn):
                    sums = self.sent_checksum(owner, pages, plan)
            except Exception:  # noqa: BLE001 - the decode node then finds no checksum, and says so
                log.exception("the KV checksum of pages %s failed", pages[:8])
            finally:
                lease.forgo(turn)  # if read never took it
            done(sums)

        _checksum_worker().submit(work)

    # --- decode ---
    def read_trailer(self, staging: jax.Array) -> list[int]:
        return [int(word) for word in np.asarray(staging)]

    def received_checksum(self, owner: Any, pages: list[int], plan: ReshardPlan) -> list[list[int]] | None:
        return pool_checksums(owner.pool, pages, [(p.dst, p.dst_slot, p.count) for p in plan.pieces],
                              self.layout.head_dim, self.checksum_algorithm)

    def corrupt(self, staging: jax.Array) -> jax.Array:
        """``FSM_PD_FAULT_CORRUPT_PULL`` on a pulled array: a copy with one byte flipped, made where the array is
        (no host bytes: any backend); the pulled array is let go."""
        flipped = _flip_first_element(staging)
        self.discard(staging)
        return flipped

    def pull_spec(self, page_count: int, piece: Piece | Trailer | None = None) -> tuple[jax.ShapeDtypeStruct]:
        if isinstance(piece, Trailer):
            return (jax.ShapeDtypeStruct((piece.words,), jnp.int32),)
        shape = self.layout.staging_shape(page_bucket(page_count))
        if piece is None or (self.layout.tp == 1 and piece.count == self.layout.slots):  # the whole staging
            return (jax.ShapeDtypeStruct(shape, self.layout.dtype, sharding=self.sharding),)
        shape = (*shape[:3], 2 * piece.count * self.layout.head_dim)  # lands on the device of its decode shard
        device = SingleDeviceSharding(self._devices()[piece.dst])
        return (jax.ShapeDtypeStruct(shape, self.layout.dtype, sharding=device),)

    def _devices(self) -> list:
        """The pool's devices, in shard order."""
        sharding = self.pool_sharding
        if isinstance(sharding, NamedSharding):
            return list(sharding.mesh.devices.flat)
        return [next(iter(sharding.device_set))]

    @property
    def stream_layers(self) -> bool:
        """D writes layers as they land only on a pool on one CPU device, where the page kernels are the CPU's
        (``resolve_impl``; see overlap.py)."""
        sharding = self.pool_sharding
        return (self.progressive and isinstance(sharding, SingleDeviceSharding)
                and next(iter(sharding.device_set)).platform == "cpu")

    def stream(self, pages: list[int]) -> StreamedScatter | None:
        if not self.stream_layers:
            return None
        # it sums crc32c as the bytes land; the device hash is taken from the pages in the final job
        return StreamedScatter(self.model, self.layout, list(pages), self.sharding,
                               checksum=self.checksum and self.checksum_algorithm == CRC32C)

    def complete_stream(self, stream: StreamedScatter, staging: jax.Array) -> bool:
        if not stream.submitted:
            return False  # nothing landed early: one whole scatter is cheaper
        stream.on_progress(0, np.asarray(staging), staging.nbytes)  # whatever the pull's last report left
        return True

    def scatter(self, owner: Any, pieces: tuple[jax.Array, ...], pages: list[int], stream: StreamedScatter | None,
                plan: ReshardPlan) -> None:
        if stream is not None:
            stream.written(owner)
            return
        staging = pieces[0] if plan.unsharded else self.assemble(pieces, plan)
        owner.pool = scatter_pages(owner.pool, staging, pages, layout=self.layout)
        jax.block_until_ready(owner.pool)

    def assemble(self, pieces: tuple[jax.Array, ...], plan: ReshardPlan) -> jax.Array:
        """The staging array a handoff between equal splits would have pulled: each decode shard's pieces and zero
        fills joined in slot order on its device, the shards then viewed as one array split like the pool."""
        landed = {piece.index: array for piece, array in zip(plan.pieces, pieces, strict=True)}
        devices = self._devices()
        shape = pieces[0].shape
        parts = []
        for dst, device in enumerate(devices):
            joined = [landed[part.index] if isinstance(part, Piece)
                      else (*shape[:3], 2 * part.count * self.layout.head_dim)
                      for part in plan.into(dst)]
            # a shard of one landed piece takes it as it is; one of zero fills only (padding heads) is made here
            alone = len(joined) == 1 and not isinstance(joined[0], tuple)
            parts.append(joined[0] if alone else _join(joined, pieces[0].dtype, device))
        if len(devices) == 1:
            return parts[0]
        whole = (*shape[:3], 2 * self.layout.slots * self.layout.head_dim)
        sharding = pool_placement(self.model.pool).staging_sharding  # as the warm-up placed it: no new compile
        return jax.make_array_from_single_device_arrays(whole, sharding, parts)

    def cancel(self, stream: StreamedScatter) -> None:
        stream.cancel()

    def discard(self, staging: Any) -> None:
        """Dropping our reference is enough: a pulled array may alias a warm host block that its backend reuses."""


_WORKER: ThreadPoolExecutor | None = None


def _checksum_worker() -> ThreadPoolExecutor:
    """One thread per process for the prefill side's checksums: in order, each under its own lease turn."""
    global _WORKER
    if _WORKER is None:
        _WORKER = ThreadPoolExecutor(1, thread_name_prefix="kv-checksum")
    return _WORKER


def _slots(part: jax.Array, lanes: slice) -> jax.Array:
    """``part[..., lanes]``, on the host for a CPU device: a slice on the device is a program per page bucket and
    peer split, compiled while a request waits (the warm-up cannot know a peer's split)."""
    if part.device.platform != "cpu":
        return part[..., lanes]
    return jax.device_put(np.ascontiguousarray(np.asarray(part)[..., lanes]), part.device)


def _join(parts: list, dtype, device) -> jax.Array:
    """The landed pieces and zero fills (shapes) of one decode shard, side by side on the slot axis: on the host
    for a CPU device, for the same reason as ``_slots``."""
    if device.platform != "cpu":
        filled = [jnp.zeros(p, dtype, device=device) if isinstance(p, tuple) else p for p in parts]
        return jnp.concatenate(filled, axis=3)
    filled = [np.zeros(p, dtype) if isinstance(p, tuple) else np.asarray(p) for p in parts]
    return jax.device_put(np.concatenate(filled, axis=3), device)


@jax.jit
def _flip_first_element(array: jax.Array) -> jax.Array:
    """The second-highest byte of the first element XOR 0xFF (the only byte of a 1-byte type): as the host hook of
    ``Faults.Corruption`` flips it, a value off by a power of two or more."""
    width = array.dtype.itemsize * 8
    bits = jax.lax.bitcast_convert_type(array, jnp.dtype(f"uint{width}"))
    first = (0,) * array.ndim
    mask = 0xFF << (width - 16) if width > 8 else 0xFF
    bits = bits.at[first].set(bits[first] ^ jnp.asarray(mask, bits.dtype))
    return jax.lax.bitcast_convert_type(bits, array.dtype)


def device_parts(staging: jax.Array) -> list[jax.Array]:
    """Each device's part of a staging array split on its slot axis (3), in slot order: one part per shard."""
    if isinstance(staging.sharding, SingleDeviceSharding):
        return [staging]
    shards = sorted(staging.addressable_shards, key=lambda shard: shard.index[3].start or 0)
    return [shard.data for shard in shards]
