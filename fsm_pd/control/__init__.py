"""The control plane in one process: the KV manager and the effect handlers that connect machines to the world.

The names below are imported on first use, so that the jax-free modules of this package (the handlers, the ports,
the node core, the admission) can be imported without jax: the simulation runs them.
"""

from fsm_pd.runtime.lazy import lazy_exports

_HOME = {
    "KVManager": "manager",
    "KVReceiver": "facades",
    "KVSender": "facades",
    "KVTransferError": "facades",
    "PrefillResolver": "resolver",
    "register_prefill": "resolver",
    "resolve_deadlines": "config",
}

__all__, __getattr__ = lazy_exports(__name__, _HOME)
