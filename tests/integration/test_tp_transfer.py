"""Handoffs between different tensor-parallel sizes (``tp_transfer_check.py``), in a fresh interpreter with 4 CPU
devices: jax fixes its device count when it first creates the CPU client, which this process may already have done.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from device_count_run import run_checks

CHECKS = Path(__file__).with_name("tp_transfer_check.py")


@pytest.mark.timeout(900)
def test_handoffs_between_tp_sizes_on_four_devices():
    result = run_checks(CHECKS, 4, cwd=CHECKS.parents[2], timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
