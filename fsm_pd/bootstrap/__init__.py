"""The bootstrap server (where prefill ranks register and decode nodes find them) and its client.

Wire-compatible with SGLang's ``CommonKVBootstrapServer``; see ``docs/bootstrap.md`` for the routes, what fsm-pd
adds, the token, the TTLs and the retries.
"""

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
from fsm_pd.bootstrap.server import BootstrapServer, create_bootstrap_app
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
