"""The two ends of a host-byte stream, shared by the backends that move staging arrays as plain bytes (zmq, tcp).

P side, ``HostEntry``: what a hold keeps alive (the published arrays' copies to the host, or the host array still
being filled), its layout digest, and the bytes to send. D side, ``Landing``: checks P's header against the spec,
lands the bytes in aligned host arrays in order, reports progress and puts every array on the device as soon as its
last byte is in (on CPU, ``device_put`` aliases the host array instead of copying it). Both copies between device
and host go as 32-bit words where a program for the array is prepared (``kernels/host_words.py``: on an
accelerator, where a TPU's bfloat16 tiles cost the host a reordering); the bytes are the same either way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.kernels.host_blocks import HostBlocks
from fsm_pd.kernels.host_words import HostCopy, to_device
from fsm_pd.transport.addresses import with_host
from fsm_pd.transport.backends.base import OnProgress, PageSource, StagingProgress, TransferFailed, check_uuid
from fsm_pd.transport.backends.holds import HoldingBackend, HoldTable
from fsm_pd.transport.backends.spec import (
    ArrayKey,
    array_key,
    array_keys,
    layout_digest,
    normalize_spec,
    spec_keys,
    summarize,
)
from fsm_pd.transport.backends.timers import scheduler


@dataclass(eq=False)
class HostEntry:
    """A published entry: the staging arrays' copies to the host (or the one host array being filled) and their host
    bytes."""

    shapes: list[tuple[tuple[int, ...], object]]
    sizes: list[int]
    digest: bytes
    summary: str
    _sources: tuple
    _host: list[memoryview | None] = field(default_factory=list)
    fill: StagingProgress | None = None  # progressive: only bytes [0, fill.final_bytes) of array 0 may be sent
    pages: PageSource | None = None  # the one array is read from the pool's pages as it is sent (never host_bytes)

    @classmethod
    def of(cls, arrays: tuple[jax.Array, ...]) -> HostEntry:
        copies = tuple(HostCopy(arr) for arr in arrays)  # started now, so that streaming does not wait for them
        keys = array_keys(arrays, count_shards=False)
        shapes = [(tuple(a.shape), a.dtype) for a in arrays]
        sizes = [a.nbytes for a in arrays]
        return cls(shapes, sizes, layout_digest(keys), summarize(keys), copies, [None] * len(arrays))

    @classmethod
    def filling(cls, progress: StagingProgress) -> HostEntry:
        host = progress.host
        keys = [array_key(host.shape, host.dtype, None)]
        view = memoryview(host.reshape(-1).view(np.uint8))
        return cls([(tuple(host.shape), host.dtype)], [host.nbytes], layout_digest(keys), summarize(keys), (host,),
                   [view], progress)

    @classmethod
    def of_pages(cls, source: PageSource) -> HostEntry:
        keys = [array_key(source.shape, source.dtype, None)]
        return cls([(tuple(source.shape), source.dtype)], [source.nbytes], layout_digest(keys), summarize(keys),
                   (source,), [None], pages=source)

    def describe(self) -> list[list]:
        """``[[shape, dtype name], ...]``: the header D checks against its spec."""
        return [[list(shape), jnp.dtype(dtype).name] for shape, dtype in self.shapes]

    def host_bytes(self, index: int) -> memoryview:
        view = self._host[index]
        if view is None:  # zero-copy on CPU; one host copy per array on accelerators
            host = self._sources[index].result()
            view = self._host[index] = memoryview(host.reshape(-1).view(np.uint8))
        return view

    def final_bytes(self, index: int) -> int:
        """How many leading bytes of array ``index`` may be sent now."""
        return self.sizes[index] if self.fill is None else self.fill.final_bytes


class Landing:
    """Where one pull's bytes land: arrays in order, each filled front to back, never a byte past the spec."""

    def __init__(self, pool: HostBlocks, uuid: int, want, want_keys: list[ArrayKey],
                 on_progress: OnProgress | None) -> None:
        self.pool, self.uuid, self.want, self.want_keys, self.on_progress = pool, uuid, want, want_keys, on_progress
        self.host: list[np.ndarray] = []
        self.flat: list[memoryview] = []
        self.placed: list[jax.Array] = []
        self.index = 0  # the array being filled
        self.offset = 0  # bytes of it already landed
        self.started = False

    def header(self, arrays: list) -> None:
        """P's description of what it publishes; checked against our spec before any byte is accepted."""
        shapes = [(tuple(shape), dtype) for shape, dtype in arrays]
        got_keys = [array_key(shape, dtype, None) for shape, dtype in shapes]
        if layout_digest(got_keys) != layout_digest(self.want_keys):  # P checked the digest too; trust neither
            raise TransferFailed(
                f"spec mismatch for transfer {self.uuid}: published {summarize(got_keys)}, "
                f"expected {summarize(self.want_keys)}",
                "local",
            )
        self.host = self.pool.arrays(shapes)
        self.flat = [memoryview(h.reshape(-1).view(np.uint8)) for h in self.host]
        self.started = True
        self._advance_past_full()

    @property
    def complete(self) -> bool:
        return self.started and self.index == len(self.host)

    def room(self) -> int:
        """Bytes left in the array being filled (0 before the header and once complete)."""
        return len(self.flat[self.index]) - self.offset if self.started and not self.complete else 0

    def target(self, nbytes: int) -> memoryview:
        """The buffer the next ``nbytes`` of the stream go into (within the current array)."""
        if not self.started or self.complete:
            raise TransferFailed(f"transfer {self.uuid}: data outside the announced arrays")
        room = len(self.flat[self.index]) - self.offset
        if not 0 < nbytes <= room:
            raise TransferFailed(f"transfer {self.uuid}: a {nbytes}-byte chunk does not fit array {self.index}")
        return self.flat[self.index][self.offset : self.offset + nbytes]

    def landed(self, nbytes: int) -> None:
        """``nbytes`` more bytes are in the buffer ``target`` gave."""
        index = self.index
        self.offset += nbytes
        if self.on_progress is not None:
            self.on_progress(index, self.host[index], self.offset)
        self._advance_past_full()

    def _advance_past_full(self) -> None:
        """Put every array whose last byte is in on the device, so host-to-device overlaps the rest."""
        while self.index < len(self.host) and self.offset == len(self.flat[self.index]):
            index = self.index
            try:
                self.placed.append(to_device(self.host[index], self.want[index].sharding))
            except Exception as exc:  # noqa: BLE001 - e.g. out of device memory on this node
                raise TransferFailed(f"transfer {self.uuid}: could not place array {index}: {exc}", "local") from exc
            self.index += 1
            self.offset = 0

    def progress_text(self) -> str:
        if not self.started:
            return "no header"
        done = sum(len(f) for f in self.flat[: self.index]) + self.offset
        return f"{done} of {sum(len(f) for f in self.flat)} bytes"


class HostStreamBackend(HoldingBackend):
    """What the byte-stream backends (zmq, tcp) share around their own server: the warm receive blocks, the address
    they advertise, and the closed flag their pulls check. ``_server`` has an ``address``; None on a pull-only node."""

    _server: object | None

    def __init__(self, *, host: str = "127.0.0.1", advertise_host: str | None = None, port: int = 0,
                 uds: str | None = None, tombstone_ttl_s: float = 600.0, recv_pool_bytes: int = 1 << 30,
                 serve: bool = True) -> None:
        """``recv_pool_bytes`` caps the warm receive blocks D keeps for reuse (``fsm_pd.kernels.host_blocks``);
        ``serve=False`` makes a pull-only node; ``address`` names ``advertise_host`` instead of the bound ``host``
        when it is given. ``uds``: serve on that unix socket path instead of ``host:port``."""
        self._advertise_host = advertise_host
        self._recv_pool = HostBlocks(recv_pool_bytes)
        self._closed = False
        self._close_lock = threading.Lock()
        self._holds = HoldTable(self._retire, tombstone_ttl_s=tombstone_ttl_s, clock=scheduler())
        self._changed = threading.Condition(self._holds.lock)  # publish, end and progress wake the senders
        self._server = self._make_server(host, port, uds) if serve else None

    def _make_server(self, host: str, port: int, uds: str | None) -> object:
        """The backend's own pull server, bound to ``host:port`` (0: any free port), or to the unix socket ``uds``."""
        raise NotImplementedError

    def pull(self, address: str, uuid: int, spec: Sequence[jax.ShapeDtypeStruct], timeout_s: float,
             on_progress: OnProgress | None = None) -> tuple[jax.Array, ...]:
        deadline = time.monotonic() + timeout_s
        check_uuid(uuid)
        want = normalize_spec(spec)
        if self._closed:
            raise TransferFailed(f"this {self.name} backend is closed", "local")
        return self._pull(address, uuid, want, spec_keys(want, count_shards=False), deadline, timeout_s, on_progress)

    def _pull(self, address: str, uuid: int, want: list, want_keys: list[ArrayKey], deadline: float,
              timeout_s: float, on_progress: OnProgress | None) -> tuple[jax.Array, ...]:
        """``pull`` once the request is checked: ``want`` is the normalized spec, ``deadline`` monotonic."""
        raise NotImplementedError

    @property
    def address(self) -> str:
        server = self._require_server()
        if self._advertise_host is None or not server.address.startswith("tcp://"):  # a unix socket has no host
            return server.address
        return with_host(server.address, self._advertise_host)

    def _require_server(self):
        if self._server is None:
            raise RuntimeError(f"this {self.name} backend was created with serve=False and publishes nothing")
        return self._server
