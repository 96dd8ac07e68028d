"""JAX's persistent compilation cache for serving nodes: a restarted node reuses the programs it compiled before.

Without it, every new process compiles its forward passes on the first request of each shape: about 2 s per
program on two CPU cores for the tiny model, far more for a real one. That lands on the first requests after a
restart, exactly when a cluster is recovering. With it, the first request of a restarted tiny node took 0.23 s
instead of 1.9 s (``docs/operations.md``).

The cache is JAX's own (keyed by the program, the jax/jaxlib versions and the device), so it is safe to share between
nodes and across upgrades. Default directory: ``$FSM_PD_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/fsm-pd/jax`` (else
``~/.cache/fsm-pd/jax``); ``off`` disables it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "FSM_PD_COMPILE_CACHE"


def default_dir(environ: os._Environ | dict = os.environ) -> str:
    explicit = environ.get(ENV)
    if explicit:
        return explicit
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "fsm-pd" / "jax")


# Every program is written, however quick to compile and however small: a warm start must load every program of its
# ready set, not compile the quick ones again. JAX's minimum entry size of 0 means "let the cache pick one" (at its
# first use it takes ``default_min_cache_entry_size()``, which a build for another file system may raise); -1 means
# no minimum, and no override.
MIN_COMPILE_TIME_S = 0.0
MIN_ENTRY_SIZE_BYTES = -1


def enable(directory: str | None) -> str | None:
    """Point JAX at ``directory`` (created if missing) and cache every program, however quick to compile and
    however small. ``None`` or ``off`` leaves the cache off. Returns the directory in use. Call it before anything
    compiles (the weights' thread included): a program compiled before is not written."""
    if not directory or directory == "off":
        return None
    import jax

    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only home, say: serving without the cache beats not serving
        log.warning("compile cache disabled: cannot create %s: %s", directory, exc)
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", MIN_ENTRY_SIZE_BYTES)
    return directory
