"""Serialized executables: a warm start loads each program it prepares ahead as the executable an earlier start
compiled, without tracing, lowering or compiling it again.

JAX's persistent compile cache (``runtime/compile_cache.py``) saves XLA's backend compile only: every start still
traces and lowers each program to find its cache key, and on a TPU v5e that was most of a warm SmolLM2 node's
programs phase (5.7 s; the decode programs with the Pallas kernels trace about 1 s each, ``docs/tpu.md``). Here a
program compiled ahead (``compiled``) is written as its executable (``jax.experimental.serialize_executable``), and
a later process that asks for the same program loads it back instead.

The key is everything that makes two programs differ, known before tracing: the function, its static arguments, the
avals, shardings and layouts of its arguments (``jax.ShapeDtypeStruct``s, as a compile ahead is given), and the
process's environment (``environment``): the jax and jaxlib versions, the backend and its version, the devices,
``XLA_FLAGS`` and libtpu's flags, jax's settings that change a program (matmul precision, x64, the PRNG), the
attention kernels chosen, and a hash of the code that builds programs (``fsm_pd/model``, ``fsm_pd/kernels``), so an
edited checkout never loads a stale executable. An entry holds its key's text, checked on load, and a digest of its
executable; a torn, corrupt or mismatched entry is logged and compiled over, never fatal. Writes are atomic (a
temporary file, renamed).

What is written must be whole. XLA:CPU (jaxlib 0.10.2) serializes a program it *loaded* (from JAX's compile cache,
or from here) without its object code: such an entry loads, and its first call fails ("Function iota_add_fusion not
found") after it has taken the donated KV pool, which is lost with it. So a program is written only where XLA
compiled it in that very call (``compiles.compiled_here``); one JAX's compile cache loaded, or jit's own memory handed
back, is not: the store fills on a start that compiles it. A program asked for again while this process holds it
(a start asks for the one-row decode program twice) is the one it holds, never a reload of the entry it just wrote. On
the CPU an entry whose executable holds no object code is refused before it loads, and the program compiled over
(``compiles.refused``): a loaded program cannot be tried once before it serves, as its first call donates the pool.

The entries live in ``executables/`` of JAX's compile cache directory, and only while that cache is on. On by
default on an accelerator and off on the CPU, where little is traced and XLA's serialization drops what it loaded;
``FSM_PD_EXECUTABLE_CACHE=on`` or ``off`` decides. Like the compile cache, the directory must be trusted: loading an
executable runs what it holds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
import weakref
from pathlib import Path

import jax
from jax.experimental import serialize_executable

from fsm_pd.model import compiles

log = logging.getLogger(__name__)

ENV = "FSM_PD_EXECUTABLE_CACHE"
FORMAT = 2  # of an entry; a new one makes every old entry a miss (1: written from loaded programs too)
# the environment variables that change what a program compiles to
FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "FSM_PD_ATTENTION", "FSM_PD_LAYERS_PER_PROGRAM")
# where an XLA:CPU executable holds its kernels: object files, one or more
OBJECT_CODE = b"\x7fELF"
# the packages whose code builds programs: an edit to any of their modules is a new key
PROGRAM_CODE = (Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent / "kernels")

_writing = threading.Lock()  # one write at a time: a few threads compile side by side
# this process's programs by key, while something holds them: a start asks for some programs twice (the one-row
# decode program), and a second ask gets the first's, as jit's own memory would hand it back, never a reload of
# what this process just wrote
_held: weakref.WeakValueDictionary[str, jax.stages.Compiled] = weakref.WeakValueDictionary()
_asking: dict[str, threading.Lock] = {}  # one compile or load per key at a time; the rest wait and share it
_asking_lock = threading.Lock()


def directory() -> Path | None:
    """Where executables are written: ``executables/`` in JAX's compile cache directory; None while that cache is
    off, with ``FSM_PD_EXECUTABLE_CACHE=off``, and on the CPU backend unless ``FSM_PD_EXECUTABLE_CACHE=on``."""
    switch = os.environ.get(ENV, "").strip().lower()
    if switch in ("off", "0", "false", "no"):
        return None
    if switch not in ("on", "1", "true", "yes") and jax.default_backend() == "cpu":
        return None
    cache = jax.config.jax_compilation_cache_dir
    # off with the compile cache, whichever way it was turned off: a test that disabled it for compiles of its own
    # loaded this store's programs instead on the chip's second run (``test_warmup.py``)
    if not cache or not jax.config.jax_enable_compilation_cache:
        return None
    return Path(cache) / "executables"


def compiled(jitted, *args, **static) -> jax.stages.Compiled:
    """``jitted.lower(*args, **static).compile()``, or the executable an earlier process wrote for the same key.
    ``args`` are ``jax.ShapeDtypeStruct``s (or arrays), ``static`` the static arguments. A program loaded here is
    counted as ``executable`` (``compiles.loaded``): JAX reports no trace, lowering or compile for it. A program
    XLA compiled in this call is written for the next process; one JAX's compile cache or jit's memory handed back
    is not (the module's docstring)."""
    folder = directory()
    if folder is None:
        return jitted.lower(*args, **static).compile()
    key = program_key(jitted, args, static)
    with _asking_lock:
        asking = _asking.setdefault(key, threading.Lock())
    with asking:
        program = _held.get(key)
        if program is None:
            program = _held[key] = _compiled_or_loaded(jitted, args, static, folder, key)
        return program


def _compiled_or_loaded(jitted, args: tuple, static: dict, folder: Path, key: str) -> jax.stages.Compiled:
    path = folder / f"{hashlib.sha256(key.encode()).hexdigest()}.exe"
    began = time.perf_counter()
    program = _load(path, key, jax.tree.structure((args, {})))
    if program is not None:
        compiles.loaded(time.perf_counter() - began)
        return program
    program, fresh = compiles.compiled_here(lambda: jitted.lower(*args, **static).compile())
    if fresh:
        _save(path, key, program)
    else:  # loaded, not compiled here: its serialization may lack its code (the docstring)
        _not_written(path)
    return program


_told = threading.Event()


def _not_written(path: Path) -> None:
    """Say once a process that a program XLA did not compile here is not written; each one at debug."""
    if _told.is_set():
        log.debug("executable cache: %s was loaded, not compiled here: not written", path.name)
        return
    _told.set()
    log.info("executable cache: programs loaded from JAX's compile cache (or handed back by jit's own) are not "
             "written here, as a loaded program may serialize without its code; a start that compiles them writes "
             "them (first: %s)", path.name)


def program_key(jitted, args: tuple, static: dict) -> str:
    """The text that names one program in this environment (``environment``)."""
    fun = getattr(jitted, "__wrapped__", jitted)
    leaves, tree = jax.tree.flatten(args)
    lines = [f"format {FORMAT}", f"program {fun.__module__}.{fun.__qualname__}",
             *(f"static {name}={value!r}" for name, value in sorted(static.items())),
             f"arguments {tree}", *(f"  {_aval(leaf)}" for leaf in leaves),
             *environment()]
    return "\n".join(lines)


def _aval(leaf) -> str:
    """A leaf's shape, dtype, sharding and layout (``repr`` of its ``ShapeDtypeStruct``)."""
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        leaf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=getattr(leaf, "sharding", None))
    return repr(leaf)


def environment() -> list[str]:
    """What a program depends on beside its arguments, read now (a test may change a flag between programs)."""
    backend = jax.devices()[0].client
    return [
        f"jax {jax.__version__} jaxlib {jax.lib.__version__}",
        f"backend {backend.platform} {backend.platform_version}",
        f"devices {[(d.id, d.device_kind, str(d)) for d in jax.devices()]}",
        *(f"env {name}={os.environ.get(name, '')}" for name in FLAG_VARIABLES),
        f"precision {jax.config.jax_default_matmul_precision} x64 {jax.config.jax_enable_x64} "
        f"prng {jax.config.jax_default_prng_impl} threefry_partitionable {jax.config.jax_threefry_partitionable}",
        f"code {code_hash()}",
    ]


@functools.cache
def code_hash() -> str:
    """A digest of every module of the packages that build programs (``PROGRAM_CODE``), read once a process."""
    digest = hashlib.sha256()
    for package in PROGRAM_CODE:
        for path in sorted(package.rglob("*.py")):
            digest.update(str(path.relative_to(package.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _load(path: Path, key: str, in_tree) -> jax.stages.Compiled | None:
    """The entry at ``path``, loaded, or None where there is none or it is not this key's whole (logged, counted and
    removed)."""
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("executable cache: cannot read %s (%s); compiling", path.name, str(exc))
        compiles.refused()
        return None
    try:
        line, _, rest = blob.partition(b"\n")
        header = json.loads(line)
        if header.get("key") != key:
            raise ValueError("it was written for another program")
        if hashlib.sha256(rest).hexdigest() != header["digest"]:
            raise ValueError("its executable does not match its digest")
        split = header["out_tree"]
        if jax.default_backend() == "cpu" and OBJECT_CODE not in rest[split:]:
            raise ValueError("it holds no object code: its first call would fail, and take the KV pool with it")
        out_tree = jax.tree_util.PyTreeDef.deserialize_using_proto(jax.tree_util.default_registry, rest[:split])
        return serialize_executable.deserialize_and_load(rest[split:], in_tree, out_tree)
    except Exception as exc:  # noqa: BLE001 - a bad entry costs a compile, never the start
        # the text, not the exception: a kept log record would keep its traceback's frames, and with them the program
        # the caller holds in ``_held`` (a test's caplog did)
        log.warning("executable cache: ignoring %s (%s: %s); compiling", path.name, type(exc).__name__, str(exc))
        compiles.refused()
        path.unlink(missing_ok=True)  # the compile may not write it again (``compiled``): refused once, not each start
        return None


def _save(path: Path, key: str, program: jax.stages.Compiled) -> None:
    """Write ``program`` at ``path``: a JSON line (its key, a digest of the rest, where the rest splits), its output
    tree (``PyTreeDef``'s own encoding), its executable. Its input tree is the key's arguments', made again on load."""
    try:
        executable, _, out_tree = serialize_executable.serialize(program)
        tree = out_tree.serialize_using_proto()
        rest = tree + executable
        header = json.dumps({"key": key, "digest": hashlib.sha256(rest).hexdigest(), "out_tree": len(tree)})
        with _writing:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(header.encode() + b"\n" + rest)
                os.replace(temporary, path)  # atomic: a reader sees the old entry, none, or this one whole
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
    except Exception as exc:  # noqa: BLE001 - not written: the next start compiles it again
        log.warning("executable cache: cannot write %s (%s: %s)", path.name, type(exc).__name__, str(exc))
