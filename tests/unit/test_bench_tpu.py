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
    for batch, step in figures["steps"].items():  # several decode steps a dispatch against one at a time
        assert step["host_step_ms"] > 0 and step["k1_ms_per_token"] > 0 and step["k4_ms_per_token"] > 0, (batch, step)
    copies = figures["copies"]
    assert copies["gather"]["GBps"] > 0 and copies["scatter"]["GBps"] > 0
    text = table.read_text()
    assert f"{figures[pools[0]]['1']['step_ms']} ms" in text and "gather" in text and "steps a dispatch" in text


def test_parity_quick_run_finds_the_chunked_batched_path_equal_to_the_whole_prompt_reference(tmp_path):
    """bench/chip_parity.py on this machine (--quick, jnp): a child process computes the float32 reference; this one
    prefills in two chunks and decodes the prompts as one ragged batch. On a CPU in float32 they must agree at every
    step, else the chunked or batched path changed the math."""
    import chip_parity

    out = tmp_path / "parity.json"
    assert chip_parity.main(["--quick", "--modes", "jnp", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    figures = report["models"]["tiny"]["jnp"]
    steps = report["models"]["tiny"]["jnp/multi-step"]  # sampled on the device, several steps a dispatch
    if report["device"].startswith("cpu"):
        assert figures["steps"] == figures["agree"] > 0, figures
        assert figures["rel_err_max"] < 1e-3
        assert steps["tokens"] == steps["agree"] > 0, steps
    else:  # bf16 on an accelerator against the float32 reference: only near-ties may differ
        assert figures["differ"] == 0, figures
        assert steps["differ"] == 0, steps
