"""Serialized executables (``model/executables.py``): a program compiled ahead is written once and loaded back by
the same key; another key (an XLA flag, a static argument) or a damaged entry is compiled, never loaded; the cache
follows JAX's compile cache, is off on the CPU unless switched on, and has an off switch. A program JAX's compile
cache handed back is not written (XLA:CPU serializes it without its code), and an entry without object code, which
loads but cannot run, is refused and compiled over. In one process jit's own caches hide whether a second lowering
traced, so these count loads (``compiles.loaded``); that a warm start traces none of its ready set's forward programs
is ``test_startup_phases.py``'s, on a served node in a fresh process."""

from __future__ import annotations

import concurrent.futures
import gc
import hashlib
import itertools
import json
import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import serialize_executable

from fsm_pd.model import compiles, executables


def scaled_sum(x, *, scale: int, salt: int = 0):
    """``(x * scale).sum()``; ``salt`` makes each test's program its own (a constant no index matches), so that
    neither jit's memory nor a compile cache the suite shares hands one test another's program."""
    return jnp.where(jnp.arange(x.shape[0]) == -1 - salt, 0.0, x * scale).sum()


_scaled_sum = jax.jit(scaled_sum, static_argnames=("scale", "salt"))
ARG = jax.ShapeDtypeStruct((7,), jnp.float32)
_salts = itertools.count((os.getpid() % 20000) * 100_000)  # int32; each process its own


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """JAX's compile cache directory pointed at ``tmp_path`` for this test (the setting only: JAX keeps the cache it
    opened first), restored after; the executable store switched on (off by default on the CPU). Nothing compiled
    here is written into a compile cache the suite shares (``tests/on_tpu.sh`` turns one on): a program compiled
    again after ``jax.clear_caches()`` must be compiled, as in a later process, not handed back by that cache."""
    monkeypatch.setenv(executables.ENV, "on")
    was = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    yield tmp_path / "executables"
    jax.config.update("jax_compilation_cache_dir", was[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", was[1])


@pytest.fixture
def salt() -> int:
    return next(_salts)


def _loaded() -> int:
    return sum(cost.from_executable for cost in compiles.costs().values())


def _refused() -> int:
    return sum(cost.refused for cost in compiles.costs().values())


def _run(program) -> float:
    return float(program(jnp.arange(7.0)))


def test_a_program_is_written_once_then_loaded_without_a_trace(cache_dir, salt):
    first = executables.compiled(_scaled_sum, ARG, scale=3, salt=salt)
    assert _run(first) == 63.0
    entries = sorted(cache_dir.iterdir())
    assert len(entries) == 1
    before = _loaded()
    del first  # as a later process: nothing here holds the program (``test_a_second_ask_...``)
    gc.collect()
    again = executables.compiled(_scaled_sum, ARG, scale=3, salt=salt)
    assert _run(again) == 63.0
    assert _loaded() == before + 1
    assert sorted(cache_dir.iterdir()) == entries, "nothing new written"


def test_a_second_ask_while_the_first_is_held_gets_it_neither_reloaded_nor_compiled(cache_dir, salt):
    """A start asks for some programs twice (the one-row decode program): the second ask, at once or later, shares
    the first's program; it is not loaded back from the entry the first just wrote (a cold start then counted a
    program "from the executable cache")."""
    programs = lambda: sum(cost.programs for cost in compiles.costs().values())  # noqa: E731
    before = programs(), _loaded()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        asked = list(pool.map(lambda _: executables.compiled(_scaled_sum, ARG, scale=3, salt=salt), range(4)))
    asked.append(executables.compiled(_scaled_sum, ARG, scale=3, salt=salt))
    assert all(program is asked[0] for program in asked) and _run(asked[0]) == 63.0
    assert (programs(), _loaded()) == (before[0] + 1, before[1]), "compiled once, never loaded"
    assert len(list(cache_dir.iterdir())) == 1


def test_another_static_argument_or_xla_flag_is_another_program(cache_dir, monkeypatch, salt):
    executables.compiled(_scaled_sum, ARG, scale=3, salt=salt)
    before = _loaded()
    assert _run(executables.compiled(_scaled_sum, ARG, scale=5, salt=salt)) == 105.0
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")  # a flag this process never reads again
    jax.clear_caches()  # else jit's memory hands back the program compiled without it, which is not written
    assert _run(executables.compiled(_scaled_sum, ARG, scale=3, salt=salt)) == 63.0
    assert _loaded() == before, "neither was loaded"
    assert len(list(cache_dir.iterdir())) == 3


@pytest.mark.parametrize("damage", ["torn", "another program's", "another executable"])
def test_a_damaged_entry_is_compiled_over_logged_and_removed(cache_dir, caplog, damage, salt):
    executables.compiled(_scaled_sum, ARG, scale=3, salt=salt)
    (entry,) = cache_dir.iterdir()
    blob = entry.read_bytes()
    if damage == "torn":
        entry.write_bytes(blob[: len(blob) // 2])
    elif damage == "another program's":
        executables.compiled(_scaled_sum, ARG, scale=5, salt=salt)
        other = next(p for p in cache_dir.iterdir() if p != entry)
        entry.write_bytes(other.read_bytes())
    else:  # this program's key, another program's executable: only the digest tells
        executables.compiled(_scaled_sum, ARG, scale=5, salt=salt)
        other = next(p for p in cache_dir.iterdir() if p != entry).read_bytes()
        entry.write_bytes(blob.partition(b"\n")[0] + b"\n" + other.partition(b"\n")[2])
    _compiled_over(entry, caplog, salt, "ignoring")


def _compiled_over(entry, caplog, salt: int, said: str) -> None:
    """``entry`` (``scaled_sum`` at scale 3) is refused: logged, counted and removed; the program compiles and runs
    right; compiled afresh in a later process (here: jit's memory emptied), it is written whole and loaded after."""
    before = _loaded(), _refused()
    with caplog.at_level(logging.WARNING, logger=executables.__name__):
        program = executables.compiled(_scaled_sum, ARG, scale=3, salt=salt)
    assert _run(program) == 63.0, "the right program, compiled"
    del program  # as a later process would (``_held``)
    gc.collect()
    assert _loaded() == before[0] and said in caplog.text
    assert _refused() == before[1] + 1 and not entry.exists()
    jax.clear_caches()
    assert _run(executables.compiled(_scaled_sum, ARG, scale=3, salt=salt)) == 63.0 and entry.exists()
    assert _run(executables.compiled(_scaled_sum, ARG, scale=3, salt=salt)) == 63.0
    assert _loaded() == before[0] + 1, "written anew, whole: loaded the next time"


def test_off_with_the_switch_on_the_cpu_by_default_or_without_the_compile_cache(cache_dir, monkeypatch, salt):
    assert executables.directory() == cache_dir
    monkeypatch.setenv(executables.ENV, "off")
    assert executables.directory() is None
    assert _run(executables.compiled(_scaled_sum, ARG, scale=3, salt=salt)) == 63.0
    assert not cache_dir.exists()
    monkeypatch.delenv(executables.ENV)
    assert jax.default_backend() == "cpu" and executables.directory() is None, "off on the CPU unless switched on"
    monkeypatch.setenv(executables.ENV, "on")
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # the cache off with its directory still named
    try:
        assert executables.directory() is None
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    assert executables.directory() == cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    assert executables.directory() is None


def test_the_key_names_the_code_and_the_argument_placements(cache_dir):
    key = executables.program_key(_scaled_sum, (ARG,), {"scale": 3})
    assert f"code {executables.code_hash()}" in key and "scaled_sum" in key
    placed = jax.ShapeDtypeStruct((7,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert executables.program_key(_scaled_sum, (placed,), {"scale": 3}) != key
    assert executables.program_key(_scaled_sum, (jax.ShapeDtypeStruct((7,), jnp.int32),), {"scale": 3}) != key


def _what_a_loaded_program_serializes_to(entry) -> bytes:
    """The entry an earlier version wrote when JAX's compile cache handed a program back: this key and a right
    digest, and the executable as XLA:CPU serializes a program it loaded (no object code)."""
    line, _, rest = entry.read_bytes().partition(b"\n")
    header = json.loads(line)
    tree = rest[: header["out_tree"]]
    out_tree = jax.tree_util.PyTreeDef.deserialize_using_proto(jax.tree_util.default_registry, tree)
    loaded = serialize_executable.deserialize_and_load(rest[header["out_tree"]:], jax.tree.structure(((ARG,), {})),
                                                       out_tree)
    executable = serialize_executable.serialize(loaded)[0]
    assert executables.OBJECT_CODE in rest and executables.OBJECT_CODE not in executable, "XLA:CPU as of this writing"
    header["digest"] = hashlib.sha256(tree + executable).hexdigest()
    return json.dumps(header).encode() + b"\n" + tree + executable


def test_an_entry_that_loads_but_cannot_run_is_refused_and_compiled_over(cache_dir, caplog, salt):
    """Loaded, it would fail its first call ("Function ... not found"), and in a node take the donated KV pool with
    it; refused, the program compiles and runs right."""
    executables.compiled(_scaled_sum, ARG, scale=3, salt=salt)
    (entry,) = cache_dir.iterdir()
    entry.write_bytes(_what_a_loaded_program_serializes_to(entry))
    _compiled_over(entry, caplog, salt, "holds no object code")


# In a fresh process, with JAX's compile cache on: a program compiled, then the compile cache's load of it (as on a
# start whose executables are gone), then the same again from jit's memory (a start asks for the one-row decode program
# twice: for the samplers' placement, and as a forward shape).
TWICE = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    from fsm_pd.model import compiles, executables
    from fsm_pd.runtime import compile_cache
    compile_cache.enable(sys.argv[1])
    scaled_sum = jax.jit(lambda x, *, scale: (x * scale).sum(), static_argnames=("scale",))
    arg = jax.ShapeDtypeStruct((7,), jnp.float32)
    folder = executables.directory()
    runs = []
    first = executables.compiled(scaled_sum, arg, scale=3)
    written = {p.name: executables.OBJECT_CODE in p.read_bytes() for p in folder.iterdir()}
    for p in folder.iterdir():
        p.unlink()
    runs.append(float(first(jnp.arange(7.0))))
    del first  # else a second ask shares it (``_held``)
    jax.clear_caches()
    again = executables.compiled(scaled_sum, arg, scale=3)  # the compile cache's load
    after_load = [p.name for p in folder.iterdir()]
    from_cache = sum(c.from_cache for c in compiles.costs().values())
    runs.append(float(again(jnp.arange(7.0))))
    del again
    # asked again: jit's memory or the compile cache hands it back (the memory holds it while something does)
    third = executables.compiled(scaled_sum, arg, scale=3)
    runs.append(float(third(jnp.arange(7.0))))
    print(json.dumps({"first": written, "again": after_load, "third": [p.name for p in folder.iterdir()],
                      "from_cache": from_cache, "runs": runs}))
""")


@pytest.mark.timeout(120)
def test_a_program_the_compile_cache_handed_back_is_not_written(tmp_path):
    done = subprocess.run([sys.executable, "-c", TWICE, str(tmp_path / "jax")], capture_output=True, text=True,
                          timeout=110, env={**os.environ, executables.ENV: "on"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert list(out["first"].values()) == [True], "the compiled program is written, with its code"
    assert out["from_cache"] == 1, "the second compile was the compile cache's load"
    assert out["again"] == [], "and it is not written"
    assert out["third"] == [], "nor is it when it is handed back again"
    assert out["runs"] == [63.0, 63.0, 63.0]
