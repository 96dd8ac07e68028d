"""bench/host_buffer.py times the open and host copies in a fresh process per buffer size, and says which failed."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# this environment (a TPU host's jax is on PYTHONPATH), on the CPU, with no buffer size named
CPU_ENV = {**{k: v for k, v in os.environ.items() if k != "TPU_PREMAPPED_BUFFER_SIZE"}, "JAX_PLATFORMS": "cpu"}


def test_each_size_is_measured_in_its_own_process(tmp_path):
    out = tmp_path / "buffer.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/host_buffer.py"), "--sizes", "0,64", "--big-mib", "4",
                           "--json", str(out)], capture_output=True, text=True, timeout=120,
                          env=CPU_ENV)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["size_mib"] for row in rows] == [0, 64]
    for row in rows:
        assert row["platform"] == "cpu"
        assert row["open_s"] >= 0 and row["up_big_gbps"] > 0 and row["down_gbps"] > 0 and row["up_8mib_ms"] > 0
    lines = done.stdout.splitlines()
    assert lines[0].strip().startswith("default:") and "64 MiB:" in lines[1] and "the first)" in lines[1]


def test_a_size_whose_process_fails_is_reported_and_fails_the_run():
    done = subprocess.run([sys.executable, str(ROOT / "bench/host_buffer.py"), "--sizes", "0", "--timeout", "0.05"],
                          capture_output=True, text=True, timeout=120,
                          env=CPU_ENV)
    assert done.returncode == 1
    assert "failed:" in done.stdout
