"""``bench/chip_open.py`` runs on a CPU: it opens the devices in a fresh process, counts the interpreter's loop after
the open, and lowers a program for the platform named before the devices are asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_probe_reports_the_open_and_a_lowering_for_the_platform(tmp_path):
    out = tmp_path / "open.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "bench/chip_open.py", "--lower", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["devices"] and figures["devices"][0].startswith("cpu")
    assert figures["open_s"] >= 0 and figures["loop_after_open"] > 0
    assert figures["lower"] == "ok" and figures["compile_after_open_s"] > 0
    assert "open_s: " in done.stdout
