"""bench/load.py keeps working: ``--quick`` on the tiny model against a colocated node and ``--role pd --pd-policy
always``, over unix sockets, as on a TPU host. Every request is answered with exactly the tokens it asked for, the
figures in the JSON are the ones its records give, each pd figure has its ratio to colocated's, and the bench leaves
none of the processes it started behind, also when it is stopped halfway."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from processes import dies_with_parent
from xla_flags import for_cold_starts

BENCH = Path(__file__).resolve().parents[2] / "bench" / "load.py"
REQUESTS = 6
RUNS = 2
NEW_TOKENS = {"prefill-heavy": 16, "decode-heavy": 128, "mixed": 48}  # the mixes
LONG_TOKENS = 900
# The bench's nodes start on empty caches and compile most of what they run during its warm-up wave (the suite skips
# their start-up warm-up): XLA's cheapest compiles there (on the CPU), as they compile more than they run here
COLD_NODES = {**os.environ, "XLA_FLAGS": for_cold_starts()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_answers_every_request_with_its_tokens_and_ratios(tmp_path):
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, str(BENCH), "--quick", "--targets", "colocated,pd-always", "--requests",
                          str(REQUESTS), "--streams", "4", "--isolated", "1", "--runs", str(RUNS), "--uds-dir",
                          str(tmp_path / "run"), "--json", str(out)], capture_output=True, text=True, timeout=280,
                         cwd=tmp_path, env=COLD_NODES, preexec_fn=dies_with_parent(signal.SIGTERM))  # its nodes too
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["problems"] == [] and report["runs"] == RUNS
    assert list(report["targets"]) == ["colocated", "pd-always"]
    short = report["prompt_plan"]["tokens"]["short"]
    assert 30 <= short <= 40, short  # the tiny model's chat template alone is 35 tokens: no digits then
    engines = {"colocated": {"node"}, "pd-always": {"prefill", "decode"}}
    for name, result in report["targets"].items():
        fill = result["fill_start"]
        for start in (fill, result):  # both starts stopped, each after /server_info said its engines' compile ended
            assert start["exit_code"] == 0 and not alive(start["pid"]), name
            assert set(start["background"]) == engines[name], start["background"]
            assert all(isinstance(r, dict) for r in start["background"].values()), start["background"]
            assert 0 < start["health_s"] <= start["background_done_s"], name
        assert fill["pid"] != result["pid"] and "--uds" in fill["argv"]
        assert fill["argv"][fill["argv"].index("--uds") + 1] != result["argv"][result["argv"].index("--uds") + 1]
        assert 0 < result["health_s"] <= result["first_answer_s"] <= result["background_done_s"], name
        assert len(result["runs"]) == RUNS
        # the prefill budget at the end: both targets timed their decode steps and some prefill sizes, and say so
        budget = result["prefill_budget"]
        assert budget["decode_ms"] > 0 and budget["prefill_ms"] and set(budget["prefill_ms"]) == set(
            budget["prefill_samples"]), (name, budget)
        # the step loop over the measured runs alone: its steps ran, and every gap is one kind or the other
        loop = result["step_loop"]
        assert loop["steps"] > 0 and loop["busy_s"] > 0 and loop["waits"] < loop["steps"], (name, loop)
        assert loop["waited_s"] >= 0 and loop["idle_s"] >= 0, loop
        for mix, median in result["mixes"].items():
            runs = [run["mixes"][mix] for run in result["runs"]]
            for figures in runs:
                check_figures(report, name, mix, figures)
            for figure in ("output_tok_s", "req_s", "ttft_p90_s", "tpot_p90_s", "goodput_req_s"):
                assert median[figure] == pytest.approx(statistics.median(r[figure] for r in runs)), (name, figure)
            assert median["requests"] == REQUESTS and median["runs"] == RUNS
    base = report["targets"]["colocated"]["mixes"]
    for mix, ratios in report["ratios"]["pd-always"].items():
        pd = report["targets"]["pd-always"]["mixes"][mix]
        assert ratios["output_tok_s"] > 0
        assert ratios["output_tok_s"] == pytest.approx(pd["output_tok_s"] / base[mix]["output_tok_s"])
        assert ratios["tpot_p90"] > 0 and ratios["ttft_p90"] > 0
        if base[mix]["goodput_req_s"]:
            assert ratios["goodput"] == pytest.approx(pd["goodput_req_s"] / base[mix]["goodput_req_s"])
    assert sorted(report["ratios"]["pd-always"]) == sorted(NEW_TOKENS)
    # every request of the measured start (the isolated ones, the warm-up wave, the runs) was a handoff that ended
    # Success on both sides, and replay agrees with the journals; none was served whole
    handoffs = report["targets"]["pd-always"]["handoffs"]
    assert handoffs["consistent"] and handoffs["local"] == 0
    assert handoffs["rooms"] == handoffs["success"] >= RUNS * REQUESTS * len(NEW_TOKENS), handoffs
    table = run.stdout
    for mix in NEW_TOKENS:
        for i, each in enumerate(report["targets"]["pd-always"]["runs"], 1):
            assert f"| pd-always | {mix} | {i} | {each['mixes'][mix]['output_tok_s']:.0f} |" in table
        tok_s = report["targets"]["pd-always"]["mixes"][mix]["output_tok_s"]
        assert f"| pd-always | {mix} | **median** | {tok_s:.0f} |" in table
        assert f"{report['ratios']['pd-always'][mix]['output_tok_s']:.2f}x |" in table
    for name, result in report["targets"].items():
        assert re.search(rf"\| {name} \| {result['prefill_budget']['decode_ms']:.1f} \| [0-9]+: ", table), name
        assert f"| {name} | {result['step_loop']['steps']} | " in table, name
    assert re.search(r"\| colocated \| fill \| [0-9.]+ \| - \| 0 \| [0-9.]+ \| node skipped \| 0 \|", table)


def check_figures(report: dict, name: str, mix: str, figures: dict) -> None:
    """One run of a mix on a target: every request answered with its tokens, the figures its records give."""
    records = figures["records"]
    assert len(records) == figures["requests"] == figures["answered"] == REQUESTS, (name, mix)
    assert all(r["ok"] for r in records), (name, mix)
    assert [r["completion_tokens"] for r in records] == [NEW_TOKENS[mix]] * REQUESTS, (name, mix)
    kinds = ["long"] * REQUESTS if mix == "prefill-heavy" else (
        ["short"] * REQUESTS if mix == "decode-heavy" else ["long", "short", "short"] * (REQUESTS // 3))
    assert [r["kind"] for r in records] == kinds, (name, mix)
    short = report["prompt_plan"]["tokens"]["short"]
    want = [LONG_TOKENS if kind == "long" else short for kind in kinds]
    assert [r["prompt_tokens"] for r in records] == want, (name, mix)
    # no prompt shares a first page with one sent before, on this run or an earlier one (the tags differ)
    assert [r["cached_tokens"] for r in records] == [0] * REQUESTS, (name, mix)
    assert figures["output_tokens"] == NEW_TOKENS[mix] * REQUESTS
    assert figures["output_tok_s"] == pytest.approx(figures["output_tokens"] / figures["seconds"])
    assert figures["req_s"] == pytest.approx(REQUESTS / figures["seconds"])
    for r in records:  # the first token, then one gap per later token, within the request's own time
        assert r["ttft_s"] > 0 and r["tpot_s"] > 0, (name, mix, r)
        assert r["ttft_s"] + r["tpot_s"] * (r["completion_tokens"] - 1) <= r["e2e_s"] + 1e-6, (name, mix, r)
    assert 0 < figures["ttft_p50_s"] <= figures["ttft_p90_s"] < figures["seconds"]
    assert 0 < figures["tpot_p50_s"] <= figures["tpot_p90_s"]
    met = sum(r["ttft_s"] <= report["slo"][mix][r["kind"]]["ttft_s"]
              and r["tpot_s"] <= report["slo"][mix][r["kind"]]["tpot_s"] for r in records)
    assert figures["slo_met"] == met and figures["goodput_req_s"] == pytest.approx(met / figures["seconds"])
    # --pd-policy always: every request through the prefill engine; the colocated node has no router
    assert figures["routes"] == ({"pd": REQUESTS} if name == "pd-always" else {"-": REQUESTS}), (name, mix)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stopped_halfway_it_stops_the_node_it_started(tmp_path):
    """SIGTERM to the bench while its first node serves: the bench stops that node (by its PID) and exits 130."""
    bench = subprocess.Popen([sys.executable, str(BENCH), "--quick", "--targets", "colocated", "--requests", "400",
                              "--uds-dir", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=tmp_path, env=COLD_NODES,
                             preexec_fn=dies_with_parent(signal.SIGTERM))  # the bench stops its node on SIGTERM
    try:
        pids = {}
        for line in bench.stderr:  # "colocated (fill start): pid N", its stop, the measured start, its first answer
            found = re.search(r"\((\w+) start\): pid (\d+)", line)
            pids |= {found.group(1): int(found.group(2))} if found else {}
            if "first answer" in line:
                break
        assert set(pids) == {"fill", "measured"} and not alive(pids["fill"]) and alive(pids["measured"])
        pid = pids["measured"]
        bench.send_signal(signal.SIGTERM)  # the node answered its first chat: the bench is warming it up
        bench.communicate(timeout=90)
        assert bench.returncode == 130
        assert not alive(pid)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
