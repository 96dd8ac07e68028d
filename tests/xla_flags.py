"""XLA's flags for the suite on a CPU: the cheapest compiles for the pytest processes, cheaper ones that cost nothing at
run time for the processes tests start.

Most of a test process's CPU time is XLA compiling the tiny model's programs, once per pool shape and module, with no
cache between processes. ``FAST_COMPILE`` makes XLA's CPU compiler cheap: LLVM at -O0 with its expensive passes off,
the loop emitters instead of the fusion emitters, one code-generation thread. On the 8 most compile-bound test files
(the model's steps, several steps a dispatch, the kernels in interpret mode) that took the CPU time from 245 s to 94 s;
a tiny forward pass compiled in 0.7 CPU-s instead of 2.7. Its programs run slower, though: a tiny decode step about
2.4 times, SmolLM2's prefill and decode 3.7 times.

The nodes, routers and checks a test starts run programs far more than they compile them (the nodes share a
persistent compile cache), so they get ``CHEAP_COMPILE`` instead: the same at LLVM -O1, whose programs ran as fast as
under XLA's defaults here (SmolLM2's prefill and decode: 1.22 CPU-s against 1.25), for a third less compile time.
Except the nodes a test starts to watch them compile (``for_cold_starts``: a warm-up on an empty cache, then a few
requests), which get ``FAST_COMPILE`` too.

XLA reads ``XLA_FLAGS`` once per process, when jax first compiles, which is how one process can hold one set while its
children inherit the other (``use_fast_compile``). The arithmetic stays IEEE's under both (no fast math), and the
checks that compare two paths of the model, or the model with transformers, hold as they do under the defaults.

Only on the CPU: a TPU host's chip process keeps its compiler's defaults (``tests/on_tpu.sh``). Where the tests share
a persistent compile cache (``FSM_PD_SUITE_COMPILE_CACHE``), every process gets ``CHEAP_COMPILE``: jax keys a cached
program by the ``XLA_FLAGS`` it reads when it compiles. ``FSM_PD_SUITE_XLA_DEFAULTS=1`` leaves XLA's defaults.
"""

from __future__ import annotations

import os

_CHEAP = ("--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false "
          "--xla_cpu_parallel_codegen_split_count=1")
FAST_COMPILE = f"--xla_backend_optimization_level=0 {_CHEAP}"
CHEAP_COMPILE = f"--xla_backend_optimization_level=1 {_CHEAP}"
DEFAULTS_ENV = "FSM_PD_SUITE_XLA_DEFAULTS"
_OURS = {flag.split("=")[0] for flag in FAST_COMPILE.split()}


def given(flags: str) -> str:
    """``flags`` without the ones this module sets: what the run was given."""
    return " ".join(f for f in flags.split() if f.split("=")[0] not in _OURS)


def use_fast_compile(environ=os.environ, *, chip_possible: bool, runs_tests: bool, shared_cache: bool) -> str | None:
    """Where jax runs on the CPU (``JAX_PLATFORMS=cpu``, or no TPU runtime: ``chip_possible`` False): if this process
    ``runs_tests``, compile here with ``FAST_COMPILE`` (jax starts now, and XLA reads them), then leave
    ``CHEAP_COMPILE`` in ``environ`` for the processes tests start. Returns the flags this process compiles with
    (None: XLA's, as given)."""
    if environ.get(DEFAULTS_ENV) == "1" or (chip_possible and environ.get("JAX_PLATFORMS") != "cpu"):
        return None
    base = given(environ.get("XLA_FLAGS", ""))
    children = f"{base} {CHEAP_COMPILE}".strip()
    here = children
    if runs_tests and not shared_cache:
        here = f"{base} {FAST_COMPILE}".strip()
        environ["XLA_FLAGS"] = here
        import jax

        jax.jit(lambda x: x + 1)(0)  # XLA parses XLA_FLAGS at its first compile, once for the process
    environ["XLA_FLAGS"] = children
    return here


def for_cold_starts(flags: str | None = None) -> str:
    """``XLA_FLAGS`` for a node a test starts to watch it compile its programs (its warm-up on, an empty compile cache)
    and then sends a few requests: ``FAST_COMPILE`` where the processes tests start have ``CHEAP_COMPILE`` (the CPU;
    such a node compiles far more than it runs: a decode node's ready set, about 2 s instead of 5), else ``flags`` (by
    default this process's) as they are. The node still starts on a compile of its own: a test that watches the start
    sees the same phases, shorter."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    return flags.replace(CHEAP_COMPILE, FAST_COMPILE) if CHEAP_COMPILE in flags else flags


def with_host_devices(count: int) -> str:
    """``XLA_FLAGS`` for a child process that needs ``count`` CPU devices: the flags children get (above) and the
    device count."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
