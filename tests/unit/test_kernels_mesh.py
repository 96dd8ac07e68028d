"""Runs the sharded-pool kernel checks in a fresh interpreter that sees 2 CPU devices.

jax fixes its CPU device count when it first creates the CPU client, which this process has already done (or may do
for another test), so the flag cannot be set here; see ``kernels_mesh/mesh_kernels_check.py``.
"""

from __future__ import annotations

from pathlib import Path

from device_count_run import run_checks

CHECKS = Path(__file__).parent / "kernels_mesh" / "mesh_kernels_check.py"


def test_kernels_on_a_two_device_mesh():
    result = run_checks(CHECKS, 2, cwd=CHECKS.parents[3], timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
