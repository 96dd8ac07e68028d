"""The ``device`` transfer backend: a handoff between two engines in one process (``fsm-pd serve --role pd``).

On a host where one process at a time may hold the accelerator (a TPU VM), prefill and decode run as two engines in
one process, and their KV need not leave the device: P publishes the staging arrays it gathered from its pool, and
D's pull takes those very arrays from a process-wide table (``device://PID/N`` names a node there), placed on D's
spec's sharding. Where P's arrays already sit there (the usual case: both pools on the same chip) nothing is copied
at all; else ``device_put`` copies device to device. No host staging, no serialization, no socket.

It keeps the whole contract (``base.py``): the ``HoldTable`` holds, tombstones, hold expiry and ``fail``; a pull that
parks until its uuid is published and ends within ``timeout_s``; one delivery per uuid; P's layout compared with D's
spec before anything is returned, and the arrays checked error-free (``spec.verify_pulled``). Pulls go through the
same effect handlers as every backend's (``effects/room_pull.py``), so the pull fault knobs apply unchanged.

Why aliasing is safe: staging arrays are never donated or deleted (only pools are donated), a jax array is
immutable, and P drops its reference when the hold ends; D's reference keeps the buffer alive until its scatter ran.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Sequence

import jax

from fsm_pd.transport.backends.base import (
    OnProgress,
    TransferFailed,
    TransferTimeout,
    check_uuid,
    live_staging,
)
from fsm_pd.transport.backends.holds import Hold, HoldingBackend, HoldTable, PullWaits
from fsm_pd.transport.backends.spec import (
    array_keys,
    layout_digest,
    normalize_spec,
    spec_keys,
    summarize,
    verify_pulled,
)
from fsm_pd.transport.backends.timers import scheduler

SCHEME = "device://"
_nodes: dict[str, DeviceTransferBackend] = {}  # every live device backend of this process, by address
_nodes_lock = threading.Lock()
_ids = itertools.count(1)


def node_at(address: str) -> DeviceTransferBackend | None:
    """The live backend of this process at ``address``, if any."""
    with _nodes_lock:
        return _nodes.get(address)


class DeviceTransferBackend(HoldingBackend):
    name = "device"
    scheme = SCHEME  # a subclass with its own (the tests' ``fake``) shares the process's table

    def __init__(self, *, tombstone_ttl_s: float = 600.0, uds: str | None = None, host: str | None = None,
                 advertise_host: str | None = None) -> None:
        """``uds``, ``host``, ``advertise_host``: what a node passes every backend for its transfer server; this one
        has none (its peer finds it in this process's table), so they are not used."""
        self._address = f"{self.scheme}{os.getpid()}/{next(_ids)}"
        self._holds = HoldTable(self._retire, tombstone_ttl_s=tombstone_ttl_s, clock=scheduler())
        self._changed = threading.Condition(self._holds.lock)  # pullers wait here for publish, end, close
        self._pulls = PullWaits(self._changed)  # parked pulls, and entries delivered once
        self._closed = False
        self.pulls = 0  # entries delivered by this node's pulls (the decode side's count)
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

    def _retire(self, uuid: int, reason: str, hold: Hold | None) -> None:
        self._pulls.ended(uuid)
        self._changed.notify_all()  # under the table lock, which the condition shares

    def _take(self, uuid: int, deadline: float) -> tuple[jax.Array, ...]:
        """Wait until ``uuid`` is published (or ended) and claim its single delivery."""
        with self._changed:
            hold = self._pulls.wait(uuid, deadline, lambda: self._published(uuid))
            if hold is None:
                raise TransferTimeout(f"transfer {uuid} not published on {self._address} in time")
            if self._pulls.delivered(uuid):
                raise TransferFailed(f"transfer {uuid} was already pulled and awaits release")
            self._pulls.deliver(uuid)
            return hold.payload

    def _published(self, uuid: int) -> Hold | None:
        """Under ``_changed``: ``uuid``'s hold once published; raises once it ended or the producer closed."""
        if self._closed:
            raise TransferFailed(f"producer {self._address} closed during the pull")
        reason = self._holds.tombstone(uuid)
        if reason is not None:
            raise TransferFailed(f"transfer {uuid}: {reason}")
        return self._holds.get(uuid)

    def parked_pulls(self) -> frozenset[int]:
        return self._pulls.parked()

    # ---- D side ----
    def pull(self, address: str, uuid: int, spec: Sequence[jax.ShapeDtypeStruct], timeout_s: float,
             on_progress: OnProgress | None = None) -> tuple[jax.Array, ...]:
        deadline = time.monotonic() + timeout_s
        check_uuid(uuid)
        want = normalize_spec(spec)
        node = node_at(address)
        if node is None:  # like a refused connection: no engine of this process publishes there
            where = "" if address.startswith(f"{SCHEME}{os.getpid()}/") else " (another process: the device backend " \
                "hands KV only between engines of one process, fsm-pd serve --role pd)"
            raise TransferFailed(f"no device transfer node at {address!r}{where}")
        published = node._take(uuid, deadline)
        have_keys, want_keys = array_keys(published, count_shards=False), spec_keys(want, count_shards=False)
        if layout_digest(have_keys) != layout_digest(want_keys):
            raise TransferFailed(
                f"spec mismatch for transfer {uuid}: published {summarize(have_keys)}, expected {summarize(want_keys)}",
                "local",
            )
        try:  # the same arrays where they already sit on the spec's sharding; else a device-to-device copy
            placed = [a if a.sharding == s.sharding else jax.device_put(a, s.sharding)
                      for a, s in zip(published, want, strict=True)]
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory on D's device
            raise TransferFailed(f"could not place pulled arrays: {exc}", "local") from exc
        arrays = verify_pulled(placed, want, lambda exc: TransferFailed(f"pulled array errored: {exc}"))
        with self._changed:
            self.pulls += 1
        return arrays

    def close(self) -> None:
        with _nodes_lock:
            _nodes.pop(self._address, None)
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._holds.close("producer closed")
            self._changed.notify_all()
