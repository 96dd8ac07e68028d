"""How a serving process ends once its journals are closed: now, whatever threads are left."""

from __future__ import annotations

import logging
import os
import sys


def exit_now(status: int) -> None:
    """Flush the logs and end the process with ``status``. Everything that must be saved is (the journals are
    closed); a worker thread still blocked (a bootstrap lookup retrying for 15 s) would hold the interpreter's exit,
    and a drain or a second SIGTERM must exit now."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
