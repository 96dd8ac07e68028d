"""The control plane in one process: the KV manager and the effect handlers that connect machines to the world."""

from fsm_pd.control.config import resolve_deadlines
from fsm_pd.control.facades import KVReceiver, KVSender, KVTransferError
from fsm_pd.control.manager import KVManager
from fsm_pd.control.resolver import PrefillResolver, register_prefill

__all__ = ["KVManager", "KVReceiver", "KVSender", "KVTransferError", "PrefillResolver", "register_prefill",
           "resolve_deadlines"]
