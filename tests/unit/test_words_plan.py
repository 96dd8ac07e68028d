"""The host-words programs (``kernels/host_words.py``) compiled for a TPU v5e on this machine (``bench/words_plan.py``,
libtpu's compile-only chip): for a 16-bit staging array, no op of either direction's plan reads or writes the data as
floats, the one DMA kernel that changes its bits' type aside, and the 90 MiB staging array needs no more temporary
than one array's worth; while XLA's bitcast-convert, which served until round r10 and quieted NaN payloads on the
chip, shows in the same run as such an op (the tool's baseline), which shows the tool can see it.

The tool runs in a process of its own: it must set up jax for a described chip before jax loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from real_parts import LIBTPU, TPU_AOT_SITE_ENV

pytestmark = LIBTPU

ROOT = Path(__file__).resolve().parents[2]
STAGING = [30, 256, 16, 384]  # SmolLM2-135M's 30 layers, 256 pages of 16 tokens, 384 lanes of K and V: 90 MiB


def test_a_16_bit_staging_array_is_never_read_as_floats_on_its_way_to_words_and_back(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ[TPU_AOT_SITE_ENV]}", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "words_plan.py"), "--shapes", "3x1x16x64,30x256x16x384",
                           "--dtypes", "bfloat16", "--baseline", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr[-3000:]
    assert out.is_file(), output
    report = json.loads(out.read_text())
    assert done.returncode == 0 and report["problems"] == [], output
    serving = [row for row in report["rows"] if row["program"] == "serving"]
    assert len(serving) == 2 * 2, output  # two shapes, two directions
    for row in serving:
        assert row["float_ops"] == [] and row["kernels"] == 1, row
        if row["shape"] == STAGING:
            assert row["temp_bytes"] <= 30 * 256 * 16 * 384 * 2, row
    for row in (row for row in report["rows"] if row["program"] == "baseline"):
        convert = "bitcast-convert(bf16)->u16" if row["direction"] == "down" else "bitcast-convert(u16)->bf16"
        assert convert in row["float_ops"] and row["kernels"] == 0, row


def test_two_compile_only_tools_run_at_once(tmp_path):
    """libtpu takes a one-process lock at load, chip or no chip: the tools waive it (``bench/compile_only.py``), or
    the second of two at once fails, as test_tpu_compile beside this test did under pytest-xdist."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ[TPU_AOT_SITE_ENV]}", "JAX_PLATFORMS": "cpu"}
    runs = [subprocess.Popen([sys.executable, str(ROOT / "bench" / "words_plan.py"), "--shapes", "3x1x16x64",
                              "--dtypes", "bfloat16", "--json", str(tmp_path / f"rows{n}.json")],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in range(2)]
    outputs = [run.communicate(timeout=600)[0] for run in runs]
    for n, (run, output) in enumerate(zip(runs, outputs, strict=True)):
        assert run.returncode == 0 and (tmp_path / f"rows{n}.json").is_file(), output[-3000:]
