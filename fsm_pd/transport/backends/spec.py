"""What D expects to receive, and the checks that stand between a pulled buffer and the caller.

The jax transfer library compares only byte sizes, so a same-size mismatch (f32[64] pulled as bf16[128]) would be
delivered as garbage. Every backend therefore describes what P published (shape, dtype, shard count) in a small
digest that D compares with its own spec before it trusts any byte.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp

from fsm_pd.transport.backends.base import TransferError, TransferFailed

# One array as the digest sees it: (shape, dtype name, number of per-device buffers, shape of each buffer).
ArrayKey = tuple[tuple[int, ...], str, int, tuple[int, ...]]


def default_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def normalize_spec(spec: Sequence[object]) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Spec leaves as ``ShapeDtypeStruct`` with a sharding (the jax backend needs one to allocate destinations)."""
    out = []
    for i, leaf in enumerate(spec):
        try:
            shape = tuple(int(d) for d in leaf.shape)
            dtype = jnp.dtype(leaf.dtype)
        except (AttributeError, TypeError) as exc:
            raise TypeError(f"spec[{i}] must have .shape and .dtype, got {leaf!r}") from exc
        sharding = getattr(leaf, "sharding", None) or default_sharding()
        out.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    return tuple(out)


def array_key(shape: Sequence[int], dtype: object, sharding: jax.sharding.Sharding | None) -> ArrayKey:
    """``sharding=None`` for backends that move whole arrays (zmq, fake): only shape and dtype must match.

    With a sharding (jax backend: one buffer per addressable shard, matched by index) the shard count and shard
    shape must match too: a 4-way split pulled as replicated has the same count on 4 devices, not the same bytes.
    """
    shape = tuple(int(d) for d in shape)
    if sharding is None:
        return (shape, jnp.dtype(dtype).name, 1, shape)
    return (shape, jnp.dtype(dtype).name, len(sharding.addressable_devices), tuple(sharding.shard_shape(shape)))


def array_keys(arrays: Iterable[jax.Array], *, count_shards: bool) -> list[ArrayKey]:
    return [array_key(a.shape, a.dtype, a.sharding if count_shards else None) for a in arrays]


def spec_keys(spec: Iterable[jax.ShapeDtypeStruct], *, count_shards: bool) -> list[ArrayKey]:
    return [array_key(s.shape, s.dtype, s.sharding if count_shards else None) for s in spec]


def layout_digest(keys: Iterable[ArrayKey]) -> bytes:
    """16-byte digest of an ordered list of array keys; equal digests mean the same byte layout and meaning."""
    text = ";".join(f"{_dims(shape)}:{dtype}:{shards}:{_dims(shard)}" for shape, dtype, shards, shard in keys)
    return hashlib.sha256(text.encode()).digest()[:16]


def summarize(keys: Sequence[ArrayKey], limit: int = 4) -> str:
    """Short human description for error messages: ``3 arrays [float32[4,8], bf16[8,16]x4 of [8,4], ...]``."""
    parts = [
        f"{dtype}[{_dims(shape, ',')}]" + (f"x{shards} of [{_dims(shard, ',')}]" if shards > 1 else "")
        for shape, dtype, shards, shard in keys[:limit]
    ]
    more = f", ... {len(keys) - limit} more" if len(keys) > limit else ""
    return f"{len(keys)} arrays [{', '.join(parts)}{more}]"


def _dims(shape: Sequence[int], sep: str = "x") -> str:
    return sep.join(map(str, shape))


def wait_until_ready(arrays: Sequence[jax.Array], deadline: float) -> bool:
    """Poll readiness until ``deadline`` (monotonic). True when every array is ready, errored ones included.

    Polling rather than ``block_until_ready`` keeps the deadline in our hands: a pull whose peer vanished may never
    become ready, and a blocked call could not be interrupted. Back-off keeps the poll cheap on a busy host.
    """
    pause = 50e-6
    while True:
        if all(a.is_ready() for a in arrays):
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 2e-3)


def verify_pulled(
    arrays: Sequence[jax.Array],
    spec: Sequence[jax.ShapeDtypeStruct],
    classify: Callable[[Exception], TransferError],
) -> tuple[jax.Array, ...]:
    """Confirm that ready arrays carry no error and match ``spec``; the last gate before arrays leave a backend.

    ``is_ready()`` is also True for an errored array, so ``block_until_ready`` (instant once ready) is what reveals
    the error; ``classify`` turns the runtime's error into the backend's ``TransferError``.
    """
    if len(arrays) != len(spec):
        raise TransferFailed(f"received {len(arrays)} arrays, spec has {len(spec)}", "local")
    for i, (arr, want) in enumerate(zip(arrays, spec, strict=True)):
        try:
            arr.block_until_ready()
        except Exception as exc:  # noqa: BLE001 - any runtime error on a pulled buffer means the pull failed
            raise classify(exc) from exc
        if tuple(arr.shape) != tuple(want.shape) or jnp.dtype(arr.dtype) != jnp.dtype(want.dtype):
            raise TransferFailed(
                f"array {i} is {arr.dtype}{list(arr.shape)}, spec wants {jnp.dtype(want.dtype)}{list(want.shape)}",
                "local",
            )
    return tuple(arrays)
