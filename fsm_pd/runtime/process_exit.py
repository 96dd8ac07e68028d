"""How a serving process ends once its journals are closed: now, whatever threads are left, after the cleanups
registered with ``on_exit`` (``os._exit`` runs no ``atexit`` hook, no ``finally`` of another thread)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

_cleanups: list[Callable[[], object]] = []


def on_exit(cleanup: Callable[[], object]) -> Callable[[], object]:
    """Run ``cleanup`` when ``exit_now`` ends the process, the last registered first: what the process made that
    must not outlive it (its unix socket files, a private directory), whichever thread ends it. A cleanup must be
    quick and may run after the same work was done in order (it must not mind)."""
    _cleanups.append(cleanup)
    return cleanup


def exit_now(status: int) -> None:
    """Run the ``on_exit`` cleanups, flush the logs and end the process with ``status``. Everything that must be
    saved is (the journals are closed); a worker thread still blocked (a bootstrap lookup retrying for 15 s) would
    hold the interpreter's exit, and a failed start-up, a drain or a second SIGTERM must exit now."""
    while _cleanups:
        cleanup = _cleanups.pop()
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - one cleanup's failure must not keep the others (or the exit) from running
            logging.getLogger(__name__).exception("a cleanup at exit failed")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
