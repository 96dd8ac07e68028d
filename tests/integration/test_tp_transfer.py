"""Handoffs between different tensor-parallel sizes (``tp_transfer_check.py``), in a fresh interpreter with 4 CPU
devices: jax fixes its device count when it first creates the CPU client, which this process may already have done.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = Path(__file__).with_name("tp_transfer_check.py")


@pytest.mark.timeout(900)
def test_handoffs_between_tp_sizes_on_four_devices():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CHECKS)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=CHECKS.parents[2])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
