"""The control plane in one process: the KV manager and the effect handlers that connect machines to the world."""

from fsm_pd.control.config import resolve_deadlines
from fsm_pd.control.manager import KVManager, direct_resolver

__all__ = ["KVManager", "direct_resolver", "resolve_deadlines"]
