"""Backends by name: built-ins, in-code registrations and the ``fsm_pd.transfer_backends`` entry-point group.

A third-party package adds a backend without touching fsm-pd by declaring, in its own pyproject::

    [project.entry-points."fsm_pd.transfer_backends"]
    rdma = "my_pkg.rdma:RdmaBackend"     # any callable(**opts) -> TransferBackend

Factories are resolved lazily, so naming a backend never imports the others (the jax one needs a Linux jaxlib,
the zmq one needs pyzmq).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from importlib.metadata import entry_points

from fsm_pd.transport.backends.base import TransferBackend

ENTRY_POINT_GROUP = "fsm_pd.transfer_backends"

BackendFactory = Callable[..., TransferBackend]

_BUILTINS: dict[str, str] = {
    "jax": "fsm_pd.transport.backends.jax_backend:JaxTransferBackend",
    "zmq": "fsm_pd.transport.backends.zmq_backend:ZmqTransferBackend",
    "tcp": "fsm_pd.transport.backends.tcp_backend:TcpTransferBackend",
    "device": "fsm_pd.transport.backends.device_backend:DeviceTransferBackend",  # engines of one process
    "pool": "fsm_pd.transport.backends.pool_backend:PoolHandoffBackend",  # engines of one process, one pool
}

_lock = threading.Lock()
_registered: dict[str, BackendFactory | str] = dict(_BUILTINS)


class UnknownBackendError(LookupError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown transfer backend {name!r}; known backends: {', '.join(known) or '(none)'}")
        self.name = name
        self.known = known


def register_backend(name: str, factory: BackendFactory | str, *, replace: bool = False) -> None:
    """Register ``factory`` (a callable, or a ``"module:attr"`` path imported on first use) under ``name``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise TypeError(f"factory must be callable or 'module:attr', got {factory!r}")
    with _lock:
        if name in _registered and not replace:
            raise ValueError(f"transfer backend {name!r} is already registered (pass replace=True to override)")
        _registered[name] = factory


def unregister_backend(name: str) -> None:
    """Remove an in-code registration; built-in names fall back to their built-in factory."""
    with _lock:
        _registered.pop(name, None)
        if name in _BUILTINS:
            _registered[name] = _BUILTINS[name]


def _entry_point_factories() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def backend_names() -> list[str]:
    """Every name ``create_backend`` accepts, sorted."""
    with _lock:
        names = set(_registered)
    return sorted(names | set(_entry_point_factories()))


def resolve_factory(name: str) -> BackendFactory:
    with _lock:
        factory = _registered.get(name)
    if factory is None:  # in-code registrations win over entry points, so a test or app can shadow a plugin
        ep = _entry_point_factories().get(name)
        if ep is None:
            raise UnknownBackendError(name, backend_names())
        factory = ep.load()
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    if not callable(factory):
        raise TypeError(f"transfer backend {name!r} resolved to non-callable {factory!r}")
    return factory


def create_backend(name: str, **opts: object) -> TransferBackend:
    """Build the backend registered as ``name`` with keyword options; ``UnknownBackendError`` lists known names."""
    backend = resolve_factory(name)(**opts)
    if not isinstance(backend, TransferBackend):
        raise TypeError(f"transfer backend {name!r} factory returned {type(backend).__name__}, not a TransferBackend")
    return backend
