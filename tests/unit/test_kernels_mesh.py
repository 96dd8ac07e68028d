"""Runs the sharded-pool kernel checks in a fresh interpreter that sees 2 CPU devices.

jax fixes its CPU device count when it first creates the CPU client, which this process has already done (or may do
for another test), so the flag cannot be set here; see ``kernels_mesh/mesh_kernels_check.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECKS = Path(__file__).parent / "kernels_mesh" / "mesh_kernels_check.py"


def test_kernels_on_a_two_device_mesh():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CHECKS)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=CHECKS.parents[3])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
