"""XLA's flags for the suite's processes on a CPU: the pytest process and every process a test starts (nodes, the
CLI, the mesh checks), which inherit ``XLA_FLAGS``.

Most of the suite's CPU time is XLA compiling the tiny model's programs, in the tests' own processes and in the nodes
they start. ``FAST_COMPILE`` makes XLA's CPU compiler cheap: LLVM at -O0 with its expensive passes off, the loop
emitters instead of the fusion emitters, one code-generation thread. On 2 cores that cut the CPU time of the most
compile-bound test files (the model's steps, the several-steps-a-dispatch loop, the kernels in interpret mode) from
245 s to 94 s, while a program runs up to about twice as slow: the tiny model's milliseconds do not feel it, and
SmolLM2's decode step took 1.24 times as long. The arithmetic stays IEEE's (no fast math is turned on), and the checks
that compare two paths of the model, or the model with transformers, hold under these flags as under the defaults.

Only on the CPU: a TPU host's chip process keeps its compiler's defaults (``tests/on_tpu.sh``), and
``FSM_PD_SUITE_XLA_DEFAULTS=1`` runs the suite under XLA's own defaults.
"""

from __future__ import annotations

import os

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")
DEFAULTS_ENV = "FSM_PD_SUITE_XLA_DEFAULTS"


def use_fast_compile(environ=os.environ, *, chip_possible: bool) -> None:
    """Add ``FAST_COMPILE`` to ``environ``'s ``XLA_FLAGS`` where jax runs on the CPU: ``JAX_PLATFORMS=cpu``, or no TPU
    runtime installed (``chip_possible`` False). Before jax starts its backends: it reads the flags then."""
    if environ.get(DEFAULTS_ENV) == "1" or FAST_COMPILE in environ.get("XLA_FLAGS", ""):
        return
    if environ.get("JAX_PLATFORMS") == "cpu" or not chip_possible:
        environ["XLA_FLAGS"] = f"{environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


def with_host_devices(count: int) -> str:
    """``XLA_FLAGS`` for a child process that needs ``count`` CPU devices: this process's flags (the suite's, above)
    and the device count."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
