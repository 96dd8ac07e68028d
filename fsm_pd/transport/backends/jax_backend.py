"""The ``jax`` backend: ``jax.experimental.transfer`` with every hang turned into a timely error.

Entry = ``[manifest, *staging]`` registered with ``await_pull`` under the uuid. What the library does not do, this
module does:

* P keeps time itself: a hold that ends (release, fail, expiry, close) is *replaced* by a tombstone entry — an
  error array, or an "ended" manifest on jaxlibs without ``make_error_array`` — because replacing is the only way
  to make the library drop an unpulled entry (freeing its memory) and the only way to make a late pull fail
  instead of parking forever. The library's own expiry runs only when new traffic arrives, so a periodic "kick"
  registration keeps it running for tombstones and for abandoned pulls parked on this server.
* Zero-size arrays stay off the wire (a pulled zero-byte buffer never becomes ready, jaxlib 0.10.2): D makes them
  locally; the manifest's digest still covers them.
* D polls readiness against its own deadline, and a watchdog poisons the connection if the deadline passes
  (a pull to a dead or silent peer never completes by itself). A poisoned or broken connection is dropped from
  the cache and never reused. ``is_ready()`` is True for errored arrays, so every buffer also goes through
  ``block_until_ready`` before anything is returned, and the manifest's layout digest catches same-size spec
  mismatches the library would deliver as garbage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.transport.addresses import with_host
from fsm_pd.transport.backends.base import (
    BackendUnavailable,
    OnProgress,
    TransferError,
    TransferFailed,
    TransferTimeout,
    check_uuid,
    live_staging,
)
from fsm_pd.transport.backends.holds import Hold, HoldingBackend, HoldTable
from fsm_pd.transport.backends.jax_api import (
    ServerConfig,
    TransferFeatures,
    detect_features,
    shared_server,
    wall_deadline,
)
from fsm_pd.transport.backends.jax_failures import (
    ERROR_PREFIX,
    check_manifest,
    classify_pull_error,
    refuse_dead_address,
)
from fsm_pd.transport.backends.jax_manifest import MANIFEST_BYTES, STATUS_ENDED, STATUS_OK, Manifest
from fsm_pd.transport.backends.spec import (
    array_keys,
    layout_digest,
    normalize_spec,
    summarize,
    verify_pulled,
    wait_until_ready,
)
from fsm_pd.transport.backends.timers import scheduler

log = logging.getLogger(__name__)

# Reserved for the expiry kick; issued uuids are below 2**63, so it can never collide with a transfer.
KICK_UUID = (1 << 64) - 1


def _first_device(shardings: Sequence[jax.sharding.Sharding]) -> jax.Device:
    if not shardings:
        return jax.local_devices()[0]
    return min(shardings[0].device_set, key=lambda d: d.id)


class JaxTransferBackend(HoldingBackend):
    name = "jax"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        port: int = 0,
        channels: int = 4,
        transfer_size: int = 8 << 20,
        parallel_copies: int = 8,
        tombstone_ttl_s: float = 600.0,
        kick_interval_s: float = 5.0,
        features: TransferFeatures | None = None,
    ) -> None:
        self.features = features or detect_features()
        if not self.features.available:
            raise BackendUnavailable(self.features.why_unavailable)
        self._server = shared_server(ServerConfig(host, port, channels, transfer_size, parallel_copies))
        self._advertise_host = advertise_host  # named by ``address`` instead of the bound host
        self._tombstone_ttl_s = tombstone_ttl_s
        self._holds = HoldTable(self._retire, tombstone_ttl_s=tombstone_ttl_s, clock=scheduler())
        self._conns: dict[str, object] = {}
        self._conns_lock = threading.Lock()
        self._deadlines = scheduler()
        self._closed = False
        self._kick_interval_s = kick_interval_s
        self._kick_timer = None
        if self.features.timeouts and kick_interval_s > 0:
            self._kick_array = jnp.zeros((1,), jnp.uint8)
            self._kick_timer = self._deadlines.call_later(kick_interval_s, self._kick)

    @property
    def address(self) -> str:
        bound = self._server.address()
        return bound if self._advertise_host is None else with_host(bound, self._advertise_host)

    # ---- P side ----

    def publish(self, uuid: int, staging: Sequence[jax.Array], hold_timeout_s: float) -> None:
        check_uuid(uuid)
        arrays = live_staging(staging)
        for i, arr in enumerate(arrays):
            if not arr.is_fully_addressable:
                # await_pull registers only this process's shards; D would get 1/N of the data (sglang-jax#1364).
                raise ValueError(f"staging[{i}] is not fully addressable; publish per-host local shards instead")
        keys = array_keys(arrays, count_shards=True)
        nbytes = sum(a.nbytes for a in arrays)
        manifest = Manifest(uuid, STATUS_OK, len(arrays), nbytes, layout_digest(keys), summarize(keys))
        manifest_array = jax.device_put(manifest.encode(), _first_device([a.sharding for a in arrays]))
        entry = [manifest_array, *(a for a in arrays if a.size)]

        def expose(deadline: float) -> list[jax.Array]:
            # The library's own deadline is only a backstop behind our timer (which tombstones at ``deadline``).
            self._await_pull(uuid, entry, deadline + self._tombstone_ttl_s)
            return entry

        self._holds.publish(uuid, nbytes, hold_timeout_s, expose)

    def _retire(self, uuid: int, reason: str, hold: Hold | None) -> None:
        message = f"{ERROR_PREFIX}transfer {uuid} {reason}"
        device = jax.local_devices()[0]
        try:
            if self.features.error_arrays:
                from jax.experimental.transfer import make_error_array

                aval = jax.ShapeDtypeStruct((1,), jnp.uint8, sharding=jax.sharding.SingleDeviceSharding(device))
                tombstone = [make_error_array(aval, message)]
            else:
                ended = Manifest(uuid, STATUS_ENDED, 0, 0, bytes(16), reason)
                tombstone = [jax.device_put(ended.encode(), device)]
            self._await_pull(uuid, tombstone, time.monotonic() + self._tombstone_ttl_s)
        except Exception:  # the hold is ended either way; a failed tombstone only means late pulls time out
            log.exception("could not register the tombstone of transfer %d", uuid)

    def _await_pull(self, uuid: int, arrays: list[jax.Array], deadline: float) -> None:
        if self.features.timeouts:
            self._server.await_pull(uuid, arrays, timeout=wall_deadline(deadline))
        else:
            self._server.await_pull(uuid, arrays)

    def _kick(self) -> None:
        """Any registration makes the library process its expired entries and parked pulls."""
        if self._closed:
            return
        try:
            self._await_pull(KICK_UUID, [self._kick_array], time.monotonic() + 3 * self._kick_interval_s)
        except Exception:
            log.exception("transfer-server expiry kick failed")
        self._kick_timer = self._deadlines.call_later(self._kick_interval_s, self._kick)

    # ---- D side ----

    def pull(self, address: str, uuid: int, spec: Sequence[jax.ShapeDtypeStruct], timeout_s: float,
             on_progress: OnProgress | None = None) -> tuple[jax.Array, ...]:
        # on_progress is never called: the library hands over whole arrays
        deadline = time.monotonic() + timeout_s
        check_uuid(uuid)
        want = normalize_spec(spec)
        manifest_spec = jax.ShapeDtypeStruct(
            (MANIFEST_BYTES,),
            jnp.uint8,
            sharding=jax.sharding.SingleDeviceSharding(_first_device([s.sharding for s in want])),
        )
        non_empty = [bool(np.prod(s.shape, dtype=np.int64)) for s in want]
        on_wire = [s for s, keep in zip(want, non_empty, strict=True) if keep]
        conn = self._connection(address, deadline)
        timed_out = threading.Event()

        def on_deadline() -> None:  # also unblocks a native pull() that blocks (as reported on TPU)
            timed_out.set()
            self._poison(address, conn)

        def classify(exc: Exception) -> TransferError:
            return self._classify(exc, address, conn, uuid, timed_out.is_set())

        watchdog = self._deadlines.call_at(deadline, on_deadline)
        try:
            try:
                kwargs = {"timeout": wall_deadline(deadline)} if self.features.timeouts else {}
                out = conn.pull(uuid, [manifest_spec, *on_wire], **kwargs)
            except Exception as exc:  # noqa: BLE001
                if timed_out.is_set():
                    raise classify(exc) from exc
                raise TransferFailed(f"pull request for transfer {uuid} was rejected: {exc}", "local") from exc
            # The manifest first: a tombstone or a spec mismatch fails without waiting for the bulk.
            if not wait_until_ready(out[:1], deadline):
                self._poison(address, conn)
                raise TransferTimeout(f"transfer {uuid} from {address}: nothing arrived within {timeout_s:g} s")
            check_manifest(out[0], uuid, want, classify)
            if not wait_until_ready(out[1:], deadline):
                self._poison(address, conn)
                raise TransferTimeout(f"transfer {uuid} from {address}: data incomplete after {timeout_s:g} s")
        finally:
            watchdog.cancel()
        pulled = iter(out[1:])
        arrays = [
            next(pulled) if keep else jnp.zeros(s.shape, s.dtype, device=s.sharding)
            for s, keep in zip(want, non_empty, strict=True)
        ]
        return verify_pulled(arrays, want, classify)

    def _classify(self, exc: Exception, address: str, conn: object, uuid: int, timed_out: bool) -> TransferError:
        error, connection_suspect = classify_pull_error(str(exc), address, uuid, timed_out)
        if connection_suspect:  # it may have broken the connection: never reuse it
            self._drop(address, conn)
        return error

    def _connection(self, address: str, deadline: float) -> object:
        with self._conns_lock:
            conn = self._conns.get(address)
        if conn is not None:
            return conn
        refuse_dead_address(address, deadline)
        with self._conns_lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._server.connect(address)  # lazy: never fails here, even for a dead address
                self._conns[address] = conn
            return conn

    def _poison(self, address: str, conn: object) -> None:
        self._drop(address, conn)
        if self.features.poison:
            try:
                conn._poison_connection()
            except Exception:
                log.exception("poisoning the connection to %s failed", address)
        # Without _poison_connection (jax < 0.8.1) the pending pull and its destination buffers linger until the
        # peer answers or the process exits; the connection is dropped from the cache all the same.

    def _drop(self, address: str, conn: object) -> None:
        with self._conns_lock:
            if self._conns.get(address) is conn:
                del self._conns[address]

    def forget(self, address: str) -> None:
        with self._conns_lock:
            self._conns.pop(address, None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._kick_timer is not None:
            self._kick_timer.cancel()
        self._holds.close("producer closed")
        with self._conns_lock:
            self._conns.clear()
