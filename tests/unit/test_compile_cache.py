"""The persistent compilation cache a serving node turns on: where it lives, how to turn it off, that JAX writes it."""

from __future__ import annotations

import subprocess
import sys

from fsm_pd.runtime import compile_cache


def test_the_directory_comes_from_the_environment_then_xdg_then_home(tmp_path):
    assert compile_cache.default_dir({"FSM_PD_COMPILE_CACHE": "/x/y", "XDG_CACHE_HOME": "/c"}) == "/x/y"
    assert compile_cache.default_dir({"XDG_CACHE_HOME": "/c"}) == "/c/fsm-pd/jax"
    assert compile_cache.default_dir({}).endswith("/.cache/fsm-pd/jax")
    assert compile_cache.enable("off") is None and compile_cache.enable(None) is None


def test_a_second_process_finds_the_programs_the_first_compiled(tmp_path):
    script = (
        "import jax, jax.numpy as jnp, sys\n"
        "from fsm_pd.runtime import compile_cache\n"
        "compile_cache.enable(sys.argv[1])\n"
        "print(float(jax.jit(lambda x: (x * 3).sum())(jnp.arange(7.0))))\n"
    )
    cache = tmp_path / "cache"
    first = subprocess.run([sys.executable, "-c", script, str(cache)], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and first.stdout.strip() == "63.0", first.stderr
    entries = sorted(p.name for p in cache.iterdir())
    assert entries, "the first process wrote its program to the cache"
    second = subprocess.run([sys.executable, "-c", script, str(cache)], capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and second.stdout.strip() == "63.0"
    assert sorted(p.name for p in cache.iterdir()) == entries, "the second one found it there: nothing new written"


def test_every_program_is_written_whatever_minimum_size_the_cache_would_choose(tmp_path):
    """JAX reads a minimum entry size of 0 as "let the cache choose one" at its first use; a build whose choice is
    larger than a small program would leave that program out, and every warm start would compile it again."""
    script = (
        "import jax, jax.numpy as jnp, sys\n"
        "from jax._src import compilation_cache\n"
        "compilation_cache.default_min_cache_entry_size = lambda: 1 << 40  # a cache that would skip everything\n"
        "from fsm_pd.runtime import compile_cache\n"
        "compile_cache.enable(sys.argv[1])\n"
        "print(float(jax.jit(lambda x: (x * 5).sum())(jnp.arange(3.0))))\n"
    )
    cache = tmp_path / "cache"
    run = subprocess.run([sys.executable, "-c", script, str(cache)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "15.0", run.stderr
    assert [p for p in cache.iterdir() if not p.name.endswith("-atime")], "the small program was written"
