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

The test modules themselves are compiled again by every process that collects them, and by pytest's assertion
rewriting first, which is the costly part: with nothing cached, collecting the suite took about 18 s of one core,
with the rewritten modules cached 8 (a process ``--collect-only``, idle machine), and each of the run's two workers
collects it all. ``written_while`` lets pytest write them (``__pycache__/*-pytest-*.pyc``, checked against their
source as any bytecode) while it collects, so that a later run reads them.
"""

from __future__ import annotations

import compileall
import contextlib
import sys
from pathlib import Path


def compile_package(directory: Path) -> bool:
    """Write the bytecode of every module under ``directory`` that lacks it or whose source changed since. False where
    some could not be written (a read-only tree, a module that does not compile): those processes compile it
    themselves, as before."""
    try:
        return bool(compileall.compile_dir(str(directory), quiet=2))
    except OSError:
        return False


@contextlib.contextmanager
def written_while():
    """Bytecode is written meanwhile, ``PYTHONDONTWRITEBYTECODE`` or not: for the collection of the tests (conftest.py),
    whose modules pytest rewrites and compiles in each worker."""
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, False
    try:
        yield
    finally:
        sys.dont_write_bytecode = before
