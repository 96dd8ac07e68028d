"""The bootstrap server (where prefill ranks register and decode nodes find them) and its client.

Wire-compatible with SGLang's ``CommonKVBootstrapServer``; see ``docs/bootstrap.md`` for the routes, what fsm-pd
adds, the token, the TTLs and the retries.

The server's names load its module (and FastAPI with it) on first use: a node that only looks prefill ranks up
or registers one (the control plane's resolver) starts without FastAPI.
"""

import importlib

from fsm_pd.bootstrap.client import (
    BootstrapError,
    backoff_delay,
    check_health,
    deregister_prefill_rank,
    fetch_prefill_layout,
    query_dp_ranks,
    register_dp_rank,
    register_prefill_rank,
    resolve_prefill,
)
from fsm_pd.bootstrap.registry import PrefillRegistry, RegistrationConflict
from fsm_pd.bootstrap.wire import EXTRA_FIELDS, SERVER_INFO_KEYS, BadRequest, RankRegistration

__all__ = [
    "EXTRA_FIELDS",
    "SERVER_INFO_KEYS",
    "BadRequest",
    "BootstrapError",
    "BootstrapServer",
    "PrefillRegistry",
    "RankRegistration",
    "RegistrationConflict",
    "backoff_delay",
    "check_health",
    "create_bootstrap_app",
    "deregister_prefill_rank",
    "fetch_prefill_layout",
    "query_dp_ranks",
    "register_dp_rank",
    "register_prefill_rank",
    "resolve_prefill",
]

_SERVER_NAMES = ("BootstrapServer", "create_bootstrap_app")


def __getattr__(name: str):
    if name not in _SERVER_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.server"), name)
    globals()[name] = value
    return value
