"""In-process transfer backend for the tests (registered as ``fake`` by ``tests/conftest.py``): a process-global table
of nodes.

It keeps the full contract (deadlines, tombstones, hold expiry, spec verification, one delivery per uuid) so that
code tested against it behaves the same on the real backends; it only skips the network. Pulled arrays are copies,
as they would be after a real transfer, so P may free its staging right after release.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence

import jax
import numpy as np

from fsm_pd.transport.backends.base import (
    OnProgress,
    StagingProgress,
    TransferFailed,
    TransferTimeout,
    check_uuid,
    live_staging,
)
from fsm_pd.transport.backends.holds import Hold, HoldingBackend, HoldTable
from fsm_pd.transport.backends.spec import (
    array_keys,
    layout_digest,
    normalize_spec,
    spec_keys,
    summarize,
    verify_pulled,
)
from fsm_pd.transport.backends.timers import scheduler

_nodes: dict[str, FakeTransferBackend] = {}
_nodes_lock = threading.Lock()
_ids = itertools.count(1)


class FakeTransferBackend(HoldingBackend):
    name = "fake"
    progressive = True

    def __init__(self, *, tombstone_ttl_s: float = 600.0, uds: str | None = None) -> None:
        """``uds``: the socket a node on unix sockets names for its transfer server; this backend has none (its
        peers find it in this process's table), so it is not used."""
        self._address = f"fake://{os.getpid()}/{next(_ids)}"
        self._holds = HoldTable(self._retire, tombstone_ttl_s=tombstone_ttl_s, clock=scheduler())
        self._changed = threading.Condition(self._holds.lock)  # pullers wait here for publish/end/close
        self._delivered: set[int] = set()
        self._parked: Counter[int] = Counter()  # uuids pullers wait for, not published yet; guarded by _changed
        self._closed = False
        with _nodes_lock:
            _nodes[self._address] = self

    @property
    def address(self) -> str:
        return self._address

    # ---- P side ----

    def publish(self, uuid: int, staging: Sequence[jax.Array], hold_timeout_s: float) -> None:
        arrays = live_staging(staging)
        nbytes = sum(a.nbytes for a in arrays)
        with self._changed:
            self._holds.publish(uuid, nbytes, hold_timeout_s, lambda _deadline: arrays)
            self._changed.notify_all()

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

    def _retire(self, uuid: int, reason: str, hold: Hold | None) -> None:
        self._delivered.discard(uuid)
        self._changed.notify_all()  # called under the table lock, which the condition shares

    def _take(self, uuid: int, deadline: float) -> tuple[jax.Array, ...]:
        """Wait until ``uuid`` is published (or ended) and claim its single delivery."""
        with self._changed:
            parked = False
            try:
                while True:
                    if self._closed:
                        raise TransferFailed(f"producer {self._address} closed during the pull")
                    reason = self._holds.tombstone(uuid)
                    if reason is not None:
                        raise TransferFailed(f"transfer {uuid}: {reason}")
                    hold = self._holds.get(uuid)
                    if hold is not None:
                        if uuid in self._delivered:
                            raise TransferFailed(f"transfer {uuid} was already pulled and awaits release")
                        self._delivered.add(uuid)
                        return hold.payload
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TransferTimeout(f"transfer {uuid} not published on {self._address} in time")
                    if not parked:
                        self._parked[uuid] += 1
                        parked = True
                    self._changed.wait(remaining)
            finally:
                if parked:
                    self._parked[uuid] -= 1
                    if not self._parked[uuid]:
                        del self._parked[uuid]

    def parked_pulls(self) -> frozenset[int]:
        with self._changed:
            return frozenset(self._parked)

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
        with _nodes_lock:
            node = _nodes.get(address)
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

    def close(self) -> None:
        with _nodes_lock:
            _nodes.pop(self._address, None)
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._holds.close("producer closed")
            self._changed.notify_all()
