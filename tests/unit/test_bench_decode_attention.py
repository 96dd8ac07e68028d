"""bench/decode_attention.py on this machine's CPU (``--quick``, the kernel in interpret mode): each kernel setting is
checked against the jnp path and timed, for a uniform batch and a mixed one, and the table says what the JSON says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# appended, not put first: a bench module must never shadow an installed package for the rest of the run
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import decode_attention as bench  # noqa: E402

# Not marked ``chip``, as the other benches' tests (test_bench_tpu.py says why).


def test_quick_run_checks_and_times_each_kernel_setting(tmp_path, capsys):
    out = tmp_path / "decode.json"
    argv = ["--quick", "--chunks", "auto,16", "--tails", "10", "--repeat", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert table.splitlines()[1].split() == ["case", "setting", "ms", "us/layer", "share", "vs_jnp", "max_err"]
    cases = report["figures"]
    assert list(cases) == ["smollm2-135m/page16/batch3/ctx40", "smollm2-135m/page16/batch3/ctx40+10"]
    for case, row in cases.items():
        assert row["roofline_ms"] > 0 and row["jnp_ms"] > 0, row
        settings = row["kernel"]
        # the quick tables are 8 pages wide: a block of 8 pages, a chunk of all 8 (auto) or of one (16 positions)
        assert list(settings) == ["8p/128t", "8p/16t"], settings
        for label, figures in settings.items():
            assert "error" not in figures, figures
            assert figures["max_err"] < 1e-5, (case, label)  # float32 on a CPU: the jnp path's answer
            assert figures["share"] > 0 and figures["us_per_layer"] > 0
            assert f"{case:<40} {label:<16} {figures['ms']:>9.3f}" in table
            assert set(figures) == {"ms", "us_per_layer", "share", "vs_jnp", "max_err"}
