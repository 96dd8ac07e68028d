"""In-process transfer backend for the tests (registered as ``fake`` by ``tests/conftest.py``): a process-global table
of nodes.

It keeps the full contract (deadlines, tombstones, hold expiry, spec verification, one delivery per uuid) so that
code tested against it behaves the same on the real backends; it only skips the network. Pulled arrays are copies,
as they would be after a real transfer, so P may free its staging right after release.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np

from fsm_pd.transport.backends.base import (
    OnProgress,
    StagingProgress,
    TransferFailed,
    TransferTimeout,
    check_uuid,
)
from fsm_pd.transport.backends.device_backend import DeviceTransferBackend, node_at
from fsm_pd.transport.backends.spec import (
    array_keys,
    layout_digest,
    normalize_spec,
    spec_keys,
    summarize,
    verify_pulled,
)


class FakeTransferBackend(DeviceTransferBackend):
    """The ``device`` backend's table, holds and single delivery, plus progressive entries (``publish_progressive``)
    and pulls that copy, as after a real transfer."""

    name = "fake"
    scheme = "fake://"
    progressive = True

    def publish_progressive(self, uuid: int, host: np.ndarray, hold_timeout_s: float) -> StagingProgress:
        progress = StagingProgress(host, self._wake)
        with self._changed:
            self._holds.publish(uuid, progress.nbytes, hold_timeout_s, lambda _deadline: progress)
            self._changed.notify_all()
        return progress

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _follow(self, uuid: int, progress: StagingProgress, deadline: float, on_progress: OnProgress | None):
        """Copy a progressive entry's final bytes as they appear, like a stream would; the copy once complete."""
        host = np.empty_like(progress.host)
        src, dst = progress.host.reshape(-1).view(np.uint8), host.reshape(-1).view(np.uint8)
        copied = 0
        while copied < progress.nbytes:
            with self._changed:
                while progress.final_bytes == copied:
                    if self._closed or self._holds.get(uuid) is None:
                        reason = self._holds.tombstone(uuid) or "producer closed"
                        raise TransferFailed(f"transfer {uuid} {reason} after {copied} of {progress.nbytes} bytes")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TransferTimeout(f"transfer {uuid}: {copied} of {progress.nbytes} bytes in time")
                    self._changed.wait(remaining)
                final = progress.final_bytes
            dst[copied:final] = src[copied:final]
            copied = final
            if on_progress is not None:  # outside the lock: the callback may take its time
                on_progress(0, host, copied)
        return (host,)

    # ---- D side ----

    def pull(
        self,
        address: str,
        uuid: int,
        spec: Sequence[jax.ShapeDtypeStruct],
        timeout_s: float,
        on_progress: OnProgress | None = None,
    ) -> tuple[jax.Array, ...]:
        deadline = time.monotonic() + timeout_s
        check_uuid(uuid)
        want = normalize_spec(spec)
        node = node_at(address)
        if node is None:  # like a refused connection: nobody listens there
            raise TransferFailed(f"no fake transfer node at {address!r}")
        published = node._take(uuid, deadline)
        progress = published if isinstance(published, StagingProgress) else None
        shown = (progress.host,) if progress is not None else published
        have_keys, want_keys = array_keys(shown, count_shards=False), spec_keys(want, count_shards=False)
        if layout_digest(have_keys) != layout_digest(want_keys):
            raise TransferFailed(
                f"spec mismatch for transfer {uuid}: published {summarize(have_keys)}, expected {summarize(want_keys)}",
                "local",
            )
        if progress is not None:
            published = node._follow(uuid, progress, deadline, on_progress)
        try:
            copies = [jax.device_put(a, s.sharding, may_alias=False) for a, s in zip(published, want, strict=True)]
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory on this node
            raise TransferFailed(f"could not place pulled arrays: {exc}", "local") from exc
        return verify_pulled(copies, want, lambda exc: TransferFailed(f"pulled array errored: {exc}"))
