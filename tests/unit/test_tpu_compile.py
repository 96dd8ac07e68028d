"""The serving programs compiled for a TPU v5e on this machine (``bench/tpu_compile.py``, libtpu's compile-only
chip): no program copies the KV pool into another layout, takes or returns it other than row-major, or needs
temporaries that grow with it, and ``--role pd``'s pool on a v5e compiles; while a group of layers compiled as before
the pool's layout was pinned (the tool's baseline) does all of that, which shows the tool can see it.

Each case runs the tool in a process of its own: it must set up jax for a described chip before jax loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from real_parts import LIBTPU, TPU_AOT_SITE_ENV

# slow: 12 to 56 s each under -n 2 (a compile-only chip's programs in a process of their own); a module without a slow
# test is handed to a worker in the run's last part, and this one was the run's last 80 s, the other worker idle
pytestmark = [LIBTPU, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def run_tool(tmp_path, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ[TPU_AOT_SITE_ENV]}", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "tpu_compile.py"), *args, "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr[-3000:]
    assert out.is_file(), output
    return done.returncode, json.loads(out.read_text()), output


def test_the_13_layer_step_keeps_the_pool_row_major_where_the_default_layout_copies_it(tmp_path):
    status, report, output = run_tool(tmp_path, "--layers", "13", "--pages", "64,4096", "--shapes", "8x1",
                                      "--baseline")
    assert status == 0 and report["problems"] == [], output
    big = [row for row in report["rows"] if row["pages"] == 4096]
    serving = [row for row in big if not row["program"].startswith("baseline")]
    assert {row["program"] for row in serving} >= {"forward 8x1 group of 4", "forward 8x1 group of 5",
                                                   "decode loop 8x4", "page scatter 8"}
    layer = 4096 * report["page_bytes"]  # 32 MiB: rows of 64 float32 lanes stored in 128
    for row in serving:  # scratch of a few MiB at most (the decode loop's 5.4), none of it the pool's
        assert row["relayouts"] == 0 and row["temp_bytes"] < layer // 4, row
        if row["layouts_in"]:  # the programs that take the pool (not the embedding and the head)
            assert row["layouts_in"] == row["layouts_out"] == ["2,1,0"], row
    # the same group in XLA's default layout: the pool page-minor at 4,096 pages, every layer copied both ways
    (baseline,) = [row for row in big if row["program"].startswith("baseline")]
    assert baseline["layouts_in"] == ["0,2,1"] and baseline["relayouts"] >= 6 and baseline["temp_bytes"] > 2 * layer


def test_the_pd_pool_of_a_v5e_compiles_where_the_default_layout_is_refused(tmp_path):
    status, report, output = run_tool(tmp_path, "--pd", "--layers", "2", "--pages", "4096,0", "--shapes", "1x64",
                                      "--baseline")
    assert status == 0 and report["problems"] == [], output
    # rows of 64 bfloat16 lanes stored in 128: 4 KiB a page and layer, and 0.8 of 15.75 GiB over 2 layers of that
    assert report["page_bytes"] == 16 * 128 * 2
    assert report["pages"][-1] == int(15.75 * 2**30 * 0.8) // (2 * 4096)
    pd = {row["program"]: row for row in report["rows"] if row["pages"] == report["pages"][-1]}
    assert pd["forward 1x64"]["error"] is None and pd["forward 1x64"]["temp_bytes"] < MIB
    assert "RESOURCE_EXHAUSTED" in pd["baseline 1x64 group of 2"]["error"]


def test_trace_costs_lower_the_tpu_kernels_for_the_chip_beside_the_jnp_baseline(tmp_path):
    """``--trace-costs``: the same programs with each attention, the TPU kernels lowered by Mosaic for the v5e."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ[TPU_AOT_SITE_ENV]}", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "tpu_compile.py"), "--trace-costs", "--layers", "1",
                           "--heads", "9", "--kv-heads", "3", "--head-dim", "64", "--dtype", "bfloat16",
                           "--shapes", "1x1"], env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr[-3000:]
    assert done.returncode == 0, output
    assert "FSM_PD_ATTENTION=jnp: the programs' attention is jnp" in output
    assert "FSM_PD_ATTENTION=tpu: the programs' attention is tpu" in output
    # per kind: programs (one layer: a forward shape is one program), jnp trace and lower, tpu trace and lower,
    # their ratio, the backend's seconds
    rows = {line[:14].strip(): line[14:].split() for line in done.stdout.splitlines() if "   backend " in line}
    assert set(rows) == {"decode", "decode loop", "page scatter"}, output
    assert rows["decode"][0] == "1" and float(rows["decode"][4]) > 0 and rows["decode"][5].endswith("x"), output
