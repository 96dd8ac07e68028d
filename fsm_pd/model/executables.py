"""Serialized executables of a node's forward programs: a warm start loads each shape's programs as they were
compiled, without tracing or lowering them again.

JAX's persistent compile cache (``runtime/compile_cache.py``) spares a restart the backend's compile, but its key is
the lowered program, so every start still traces and lowers each forward program first: on a warm tiny-model node on
2 cores that was most of the programs phase (``bench/startup.py``: trace and lower 1.9 s of the forward passes'
2.2 s). Here each compiled program of a forward shape is kept serialized (``jax.experimental.serialize_executable``)
under a key of everything that decides it, read without building it: the model's config, the shapes, dtypes and
placements of the weights and the pool, the attention kernels, the layer groups, the input shape, jax's and jaxlib's
versions and the settings that change programs (matmul precision, x64), the device kind and its runtime's version,
and a digest of the source of the packages the programs come from (``fsm_pd/model``, ``fsm_pd/kernels``): a changed
line of either is another key. An entry that cannot be read is logged, removed and compiled anew.

On only where a node turns it on (``enable``: ``fsm-pd serve`` with ``FSM_PD_EXECUTABLE_STORE=on``, inside the compile
cache's directory, and never while that cache is off; off by default, since a CPU executable loaded here once failed
its first call with "Function iota_add_fusion not found"), for programs on one device (a tensor-parallel node's
programs span a mesh: compiled as before). Loaded programs are counted as programs from the cache (``compiles.loaded``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
import threading
import time
from pathlib import Path

import jax
import jaxlib

from fsm_pd.model import compiles

log = logging.getLogger(__name__)

_SOURCES = ("model", "kernels")  # the packages whose code the forward programs are made of
_lock = threading.Lock()
_directory: Path | None = None
_digest: str | None = None


def enable(directory: str | Path | None) -> Path | None:
    """Keep and load forward programs in ``directory`` (created if missing); None turns it off. Returns it."""
    global _directory
    if directory is None:
        _directory = None
        return None
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("executable store off: cannot create %s: %s", path, exc)
        path = None
    _directory = path
    return path


def enabled() -> bool:
    return _directory is not None


def source_digest() -> str:
    """A digest of the source of ``fsm_pd/model`` and ``fsm_pd/kernels``, read once per process."""
    global _digest
    with _lock:
        if _digest is None:
            root = Path(__file__).resolve().parents[1]
            digest = hashlib.sha256()
            for package in _SOURCES:
                for path in sorted((root / package).rglob("*.py")):
                    digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
            _digest = digest.hexdigest()
        return _digest


def key(device, *parts) -> str:
    """The name of an entry: ``parts`` (what the caller's programs are made from, each with a stable ``repr``) and
    what the process and the device add to every program."""
    described = repr((parts, jax.__version__, jaxlib.__version__, jax.config.jax_default_matmul_precision,
                      jax.config.jax_enable_x64, device.platform, device.device_kind,
                      getattr(device.client, "platform_version", ""), source_digest()))
    return hashlib.sha256(described.encode()).hexdigest()[:40]


def save(name: str, programs: dict[str, jax.stages.Compiled]) -> None:
    """Keep ``programs`` (by role: ``embed``, ``group 6``, ...) under ``name``; a failure only costs the next start
    its compile."""
    if _directory is None:
        return
    try:
        entry = {role: jax_serialize(program) for role, program in programs.items()}
        with tempfile.NamedTemporaryFile(dir=_directory, prefix=f".{name}.", delete=False) as file:
            pickle.dump(entry, file, protocol=pickle.HIGHEST_PROTOCOL)
        os.chmod(file.name, 0o644)  # as the compile cache's own files: other nodes sharing the directory read them
        os.replace(file.name, _directory / name)  # whole or not at all, for a reader in another process
    except Exception as exc:  # noqa: BLE001 - some programs cannot be serialized (closed-over constants, ...)
        log.debug("executable store: %s not kept: %s: %s", name, type(exc).__name__, exc)


def load(name: str, device) -> dict[str, jax.stages.Compiled] | None:
    """The programs kept under ``name``, loaded onto ``device``; None where there are none (or they cannot be read:
    the entry is removed, and the caller compiles)."""
    if _directory is None:
        return None
    path = _directory / name
    began = time.monotonic()
    try:
        with open(path, "rb") as file:
            entry = pickle.load(file)
        programs = {role: jax_deserialize(serialized, device) for role, serialized in entry.items()}
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - another jaxlib's entry, a torn file: compile instead
        log.warning("executable store: cannot load %s (%s: %s); compiling it", path, type(exc).__name__, exc)
        path.unlink(missing_ok=True)
        return None
    compiles.loaded(len(programs), time.monotonic() - began)
    return programs


def jax_serialize(program: jax.stages.Compiled) -> tuple[bytes, bytes, bytes]:
    from jax.experimental.serialize_executable import serialize

    payload, in_tree, out_tree = serialize(program)
    return payload, pickle.dumps(in_tree), pickle.dumps(out_tree)


def jax_deserialize(serialized: tuple[bytes, bytes, bytes], device) -> jax.stages.Compiled:
    from jax.experimental.serialize_executable import deserialize_and_load

    payload, in_tree, out_tree = serialized
    return deserialize_and_load(payload, pickle.loads(in_tree), pickle.loads(out_tree), backend=device.client,
                                execution_devices=[device])
