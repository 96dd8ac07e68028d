"""Transfer backends: move a published staging pytree from P to D behind one contract (see ``base``).

Pick one by name with ``create_backend("jax" | "zmq" | "fake", **opts)``; add your own with ``register_backend`` or
the ``fsm_pd.transfer_backends`` entry-point group. ``docs/data-plane.md`` describes the contract and the hazards.
"""

from fsm_pd.transport.backends.base import (
    BackendUnavailable,
    OnProgress,
    OpenEntries,
    StagingProgress,
    TransferBackend,
    TransferError,
    TransferFailed,
    TransferTimeout,
    new_uuid,
)
from fsm_pd.transport.backends.registry import (
    ENTRY_POINT_GROUP,
    UnknownBackendError,
    backend_names,
    create_backend,
    register_backend,
    unregister_backend,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendUnavailable",
    "OnProgress",
    "OpenEntries",
    "StagingProgress",
    "TransferBackend",
    "TransferError",
    "TransferFailed",
    "TransferTimeout",
    "UnknownBackendError",
    "backend_names",
    "create_backend",
    "new_uuid",
    "register_backend",
    "unregister_backend",
]
