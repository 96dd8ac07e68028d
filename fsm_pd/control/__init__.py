"""The control plane in one process: the KV manager and the effect handlers that connect machines to the world.

The names below are imported on first use, so that the jax-free modules of this package (the handlers, the ports,
the node core, the admission) can be imported without jax: the simulation runs them.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "KVManager": "fsm_pd.control.manager",
    "KVReceiver": "fsm_pd.control.facades",
    "KVSender": "fsm_pd.control.facades",
    "KVTransferError": "fsm_pd.control.facades",
    "PrefillResolver": "fsm_pd.control.resolver",
    "register_prefill": "fsm_pd.control.resolver",
    "resolve_deadlines": "fsm_pd.control.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsm_pd.control' has no attribute {name!r}")
    return getattr(import_module(module), name)
