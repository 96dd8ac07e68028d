"""bench/decode_attention.py on this machine's CPU (``--quick``, the kernel in interpret mode): each setting of rows
an item is checked against the jnp path and timed against R = 1 in the same run, for a uniform batch and a mixed
one, and the table says what the JSON says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# appended, not put first: a bench module must never shadow an installed package for the rest of the run
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import decode_attention as bench  # noqa: E402

# Not marked ``chip``, as the other benches' tests (test_bench_tpu.py says why).


def test_quick_run_times_each_rows_per_item_against_one_row_an_item(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert bench.main(["--quick", "--rows-per-item", "1,2", "--tails", "10", "--repeat", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    table = capsys.readouterr().out
    cases = report["figures"]
    assert list(cases) == ["smollm2-135m/page16/batch3/ctx40", "smollm2-135m/page16/batch3/ctx40+10"]
    for case, row in cases.items():
        assert row["roofline_ms"] > 0 and row["jnp_ms"] > 0, row
        settings = row["kernel"]
        assert [label.split()[0] for label in settings] == ["R1", "R2"], settings
        for label, figures in settings.items():
            assert "error" not in figures, figures
            assert figures["max_err"] < 1e-5, (case, label)  # float32 on a CPU: the jnp path's answer
            assert figures["share"] > 0 and figures["us_per_layer"] > 0
            assert f"{case:<40} {label:<16} {figures['ms']:>9.3f}" in table
        assert [figures["vs_R1"] for figures in settings.values()][0] == 1.0  # R = 1 against itself
        assert all("vs_R1" in figures for figures in settings.values())
