"""Deadlines: defaults, and the ``FSM_PD_*`` environment variables that override them; what a room waits for under
each (``STATE_DEADLINES``, the machines' words, for the flags' help).

The bootstrap and waiting defaults are SGLang's (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` and
``..._WAITING_TIMEOUT``, 300 s). SGLang has no pull-hold or transfer deadline; ours default to 60 s: long enough for
a multi-GB pull on a slow link, short enough that an abandoned staging buffer does not pin memory for minutes.

SGLang's decode node bounds its pre-allocation queue (the wait for free KV pages) by nothing but the request; ours
has a deadline of its own there (``admission``, armed once the prefill node's address is known), 240 s: it ends
before the prefill node's bootstrap deadline (300 s), which waits for the PREPARE that comes after that queue, so
the decode node, which knows why, names the wait and tells the prefill node; and the room's deadlines in a row (the
lookup's bootstrap, admission, waiting, transfer) stay within the request's own, its first-token deadline (900 s).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from fsm_pd.machines.deadlines import STATE_DEADLINES  # noqa: F401 - what each waits for, for the flags' help

DEFAULTS = {
    "prefill": {"bootstrap": 300.0, "waiting": 300.0, "pull_hold": 60.0},
    "decode": {"bootstrap": 300.0, "admission": 240.0, "waiting": 300.0, "transfer": 60.0},
}

ENV = {
    "bootstrap": "FSM_PD_BOOTSTRAP_TIMEOUT",
    "admission": "FSM_PD_ADMISSION_TIMEOUT",
    "waiting": "FSM_PD_WAITING_TIMEOUT",
    "pull_hold": "FSM_PD_PULL_HOLD_TIMEOUT",
    "transfer": "FSM_PD_TRANSFER_TIMEOUT",
}


def heartbeat_settings(environ: Mapping[str, str] = os.environ) -> dict:
    """How often a node probes its peers and how many silent intervals declare one dead: every 1 s, 2 misses, so a
    dead peer is noticed 2 to 3 s after it stopped (SGLang's decode: every 5 s, 2 misses, against the bootstrap
    server). ``FSM_PD_HEARTBEAT_MAX_FAILURE``, the older spelling, is still read."""
    interval_text = environ.get("FSM_PD_HEARTBEAT_INTERVAL", "1.0")
    failures_text = environ.get("FSM_PD_HEARTBEAT_MAX_FAILURES", environ.get("FSM_PD_HEARTBEAT_MAX_FAILURE", "2"))
    try:
        interval, failures = float(interval_text), int(failures_text)
    except ValueError as exc:
        raise ValueError(f"FSM_PD_HEARTBEAT_INTERVAL / FSM_PD_HEARTBEAT_MAX_FAILURES: {exc}") from None
    if not interval > 0 or failures < 1:
        raise ValueError(f"FSM_PD_HEARTBEAT_INTERVAL must be positive and FSM_PD_HEARTBEAT_MAX_FAILURES at least 1, "
                         f"got {interval_text!r} and {failures_text!r}")
    return {"interval_s": interval, "max_failures": failures}


def resolve_deadlines(role: str, explicit: Mapping[str, float] | None = None,
                      environ: Mapping[str, str] = os.environ) -> dict[str, float]:
    """Defaults, overridden by the environment, overridden by explicit values (flags)."""
    deadlines = dict(DEFAULTS[role])
    for timer in deadlines:
        text = environ.get(ENV[timer])
        if text is not None:
            try:
                deadlines[timer] = float(text)
            except ValueError:
                raise ValueError(f"{ENV[timer]}={text!r} is not a number of seconds") from None
    for timer, value in (explicit or {}).items():
        if timer not in deadlines:
            raise ValueError(f"unknown {role} deadline {timer!r}; known: {sorted(deadlines)}")
        deadlines[timer] = float(value)
    for timer, value in deadlines.items():
        if not value > 0:
            raise ValueError(f"the {timer} deadline must be positive, got {value}")
    return deadlines
