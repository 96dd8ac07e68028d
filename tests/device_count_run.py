"""A pytest run of one check file in a fresh interpreter that sees ``devices`` CPU devices: jax fixes its CPU device
count when it first creates the CPU client, which the process running the suite may already have done
(``test_tensor_parallel.py``, ``test_kernels_mesh.py``, ``test_tp_transfer.py``).

The run loads only the plugins the suite's settings name (pytest-timeout for the timeouts, xdist for ``--dist`` in
pyproject's addopts), not every one this environment installs: schemathesis's and hypothesis's pytest plugins took
2.5 of a run's 4.2 CPU-s to start (the checks that draw examples with hypothesis need only the library, not its
plugin)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_checks(checks: Path, devices: int, *, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_timeout",
               "-p", "xdist.plugin", str(checks)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
