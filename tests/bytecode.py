"""fsm-pd's bytecode, compiled once per run, for the processes the tests start.

Where ``PYTHONDONTWRITEBYTECODE`` is set (this project's machines set it, and so does the Dockerfile), no process
writes the ``__pycache__`` of a package it imports from a checkout, so every process a test starts compiled fsm-pd's
modules from their source again: about 0.35 CPU-s of a tiny node's 1.8 to 2.3 (a colocated or decode ``fsm-pd
serve``, medians of four on 2 cores), 0.15 of a router's 0.9; a suite run starts hundreds of them. The variable only
stops writing: a process still reads bytecode that is there, and checks it against its source's time and size, so
an edited module is compiled from its source again. ``compile_package`` writes the package's bytecode once, in the
process that runs the suite (``conftest.py``: before pytest-xdist starts its workers), where ``__pycache__`` is
ignored by git and by the Docker build; about 0.4 s the first time, nothing while it is up to date. An installed
package (its bytecode written by pip) or a read-only checkout is left as it is.
"""

from __future__ import annotations

import compileall
from pathlib import Path


def compile_package(directory: Path) -> bool:
    """Write the bytecode of every module under ``directory`` that lacks it or whose source changed since. False where
    some could not be written (a read-only tree, a module that does not compile): those processes compile it
    themselves, as before."""
    try:
        return bool(compileall.compile_dir(str(directory), quiet=2))
    except OSError:
        return False
