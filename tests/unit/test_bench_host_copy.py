"""bench/host_copy.py on this machine's CPU (``--quick``): every way of moving a staging array to the host and back
is timed, and each one's bytes are the staging array's own, so that a faster way could carry the wire format
unchanged; what serves (``kernels/host_words.py``) is timed as such, and so are whole handoffs over the tcp and zmq
backends, plainly and as words."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # appended: never shadows an installed package
import host_copy  # noqa: E402

from fsm_pd.kernels import host_words  # noqa: E402


def test_quick_run_times_every_way_and_each_reads_the_staging_bytes(tmp_path):
    assert host_copy.main(["--quick", "--json", str(tmp_path / "out.json")]) == 0
    report = json.loads((tmp_path / "out.json").read_text())
    ways = {name: v for name, v in report.items() if isinstance(v, dict) and "GBps" in v}
    handoffs = {f"handoff_{b}_{how}" for b in ("tcp", "zmq") for how in ("plain", "words")}
    assert {"as_is", "words", "words_async", "up_as_is", "up_words", "served", "up_served", *handoffs} <= set(ways)
    assert all(v["GBps"] > 0 for v in ways.values()), report
    assert all(v["same_bytes"] for v in ways.values() if "same_bytes" in v), report
    assert report["words_shape"].startswith("uint32[") and report["words_shape"].endswith(", 128]")
    assert report["fits"] and report["served"]["words"]
    # the words ways ran as words: served (3 down, 3 + 1 up) and the words handoffs (4 each way per backend)
    assert report["copies"]["down_words"] == 3 + 8 and report["copies"]["up_words"] == 4 + 8, report["copies"]
    shape = tuple(json.loads(report["staging"].removeprefix(report["dtype"])))
    assert not host_words.is_prepared(shape, report["dtype"], jax.sharding.SingleDeviceSharding(jax.devices()[0]))
