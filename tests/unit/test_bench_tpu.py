"""bench/tpu.py on this machine's CPU (``--quick``): every figure comes with its roofline and share, the larger
pool's step is measured beside the default one's, and the report's table says what the JSON says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# appended, not put first: a bench module must never shadow an installed package for the rest of the run
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import tpu  # noqa: E402


def test_quick_run_reports_each_figure_against_its_roofline(tmp_path):
    out, table = tmp_path / "tpu.json", tmp_path / "tpu.md"
    assert tpu.main(["--quick", "--json", str(out), "--markdown", str(table)]) == 0
    report = json.loads(out.read_text())
    # a CPU's peaks are measured here; a known accelerator's come from its datasheet
    assert report["peaks"] == ("measured here" if report["device"].startswith("cpu") else "datasheet")
    assert report["hbm_GBps"] > 0 and report["peak_TFLOPs"] > 0
    figures = report["models"]["smollm2-135m"]
    pools = [key for key in figures if key.startswith("decode_pool_")]
    assert len(pools) == 2, pools  # the default pool and the larger one
    for key in pools:
        for batch, step in figures[key].items():
            assert step["step_ms"] > 0 and step["roofline_ms"] > 0, (key, batch, step)
            assert abs(step["share"] - step["roofline_ms"] / step["step_ms"]) < 0.01
    prefill = next(iter(figures["prefill"].values()))
    assert prefill["ms"] > 0 and prefill["share"] > 0
    copies = figures["copies"]
    assert copies["gather"]["GBps"] > 0 and copies["scatter"]["GBps"] > 0
    text = table.read_text()
    assert f"{figures[pools[0]]['1']['step_ms']} ms" in text and "gather" in text
