"""bench/load.py's warm, repeated runs, piece by piece: when a start's background compile is done (read from what a
node's ``Startup`` puts in ``/server_info``), the median of a mix over its runs, each run's prompts distinct from
every other run's, and the tables: a row per run, the median row with its ratios to colocated's median, the starts,
and the warnings in bold."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

# appended, not put first: a bench module must never shadow an installed package for the rest of the run
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import load  # noqa: E402
import load_report  # noqa: E402
from load_mixes import MIXES, PromptPlan, median_of_runs  # noqa: E402
from load_targets import background_done, background_state, step_loop_since  # noqa: E402

from fsm_pd.serving.startup import Startup  # noqa: E402

REPORT = {"programs": 24, "seconds": 27.5, "demanded": 0}


def test_a_node_s_background_compile_is_done_once_its_startup_says_what_it_compiled():
    startup = Startup(started_at=0.0)
    info = {"startup": startup.status()}
    assert background_state(info) == {"node": None} and not background_done(background_state(info))  # starting
    startup.mark_ready()
    assert background_state({"startup": startup.status()}) == {"node": "running"}
    assert not background_done(background_state({"startup": startup.status()}))
    startup.background_done(REPORT)
    assert background_state({"startup": startup.status()}) == {"node": REPORT}
    assert background_done(background_state({"startup": startup.status()}))


def test_role_pd_is_done_when_both_engines_are():
    """``--role pd``'s router puts each engine's start-up under ``engines_startup`` (``cli/serve_pd.py``); the
    process's ``startup`` is the prefill engine's, which ends first: it alone does not say the process is done."""
    prefill, decode = Startup(started_at=0.0, ready=True), Startup(started_at=0.0, ready=True)
    prefill.background_done(REPORT)

    def info():
        return {"startup": prefill.status(), "engines_startup": {"prefill": prefill.status(),
                                                                  "decode": decode.status()}}

    assert background_state(info()) == {"prefill": REPORT, "decode": "running"}
    assert not background_done(background_state(info()))
    decode.background_done({"skipped": True})
    assert background_done(background_state(info()))
    assert load_report.background(background_state(info())) == "prefill 24 in 27.5 s, decode skipped"
    assert not background_done({})


def summary(tok_s: float, tpot_p90: float | None, met: int) -> dict:
    return {"requests": 8, "answered": 8, "seconds": 2.0, "output_tokens": tok_s * 2, "output_tok_s": tok_s,
            "req_s": 4.0, "ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "tpot_p50_s": 0.01, "tpot_p90_s": tpot_p90,
            "slo_met": met, "attainment": met / 8, "goodput_req_s": met / 2.0, "routes": {"pd": 8}}


def test_the_median_of_runs_is_each_figure_s_median():
    runs = [summary(100, 0.02, 8), summary(400, None, 2), summary(200, 0.05, 6)]  # means differ from medians
    median = median_of_runs(runs)
    assert median["output_tok_s"] == 200 and median["slo_met"] == 6 and median["goodput_req_s"] == 3.0
    assert median["tpot_p90_s"] == pytest.approx(statistics.median([0.02, 0.05]))  # the runs that have one
    assert median["runs"] == 3 and median["requests"] == 8 and median["routes"] == {"pd": 24}


def test_every_run_sends_prompts_no_other_run_or_phase_sent():
    plan = PromptPlan(overhead=20, per_digit=1.0, lengths={"long": 900, "short": 30})
    tags = [body["messages"][0]["content"] for mix in MIXES for run in range(load.MAX_RUNS)
            for _, body in load.requests_for("load", mix, 50, plan, run)]
    tags += [body["messages"][0]["content"] for mix in MIXES for _, body in load.requests_for("warm", mix, 50, plan)]
    tags += [body["messages"][0]["content"] for mix in MIXES for _, body in load.isolated_requests(mix, 5, plan)]
    assert len(set(tags)) == len(tags) and {len(t) for t in tags} == {6}  # and each tag costs the same tokens


def test_the_table_has_a_row_per_run_and_the_median_row_with_its_ratios():
    colocated = [summary(100, 0.02, 8), summary(300, 0.02, 8)]
    pd = [summary(150, 0.03, 4), summary(210, 0.05, 6)]
    report = {"model": "tiny", "streams": 4, "requests": 8, "runs": 2, "cold": False, "tcp": False,
              "ttft_scale": 5, "tpot_scale": 2, "slo_from": "colocated", "slo": {},
              "warnings": ["pd-always compiled programs during measured run 2"], "targets": {}}
    for name, runs in (("colocated", colocated), ("pd-always", pd)):
        report["targets"][name] = {
            "pid": 1, "health_s": 5.0, "first_answer_s": 5.5, "background_done_s": 9.0,
            "background": {"node": REPORT}, "exit_code": 0, "runs": [{"mixes": {"mixed": r}} for r in runs],
            "mixes": {"mixed": median_of_runs(runs)}}
    report["targets"]["colocated"]["fill_start"] = {"pid": 2, "health_s": 30.0, "background_done_s": 60.0,
                                                    "background": {"node": "running"}, "exit_code": 0}
    table = load_report.markdown(load_report.with_ratios(report))
    assert "| pd-always | mixed | 1 | 150 | 4.00 |" in table and "| 0.75x |" in table  # run 1 against the median
    assert "| pd-always | mixed | 2 | 210 | 4.00 |" in table and "| 1.05x |" in table
    median_row = next(line for line in table.splitlines() if line.startswith("| pd-always | mixed | **median** | 180"))
    assert "| 0.90x | 0.62x | 2.00x |" in median_row  # 180/200 tok/s, goodput 2.5/4, TPOT p90 0.04/0.02
    assert "| colocated | fill | 30.0 | - | 0 | 60.0 | node NOT DONE (running) | 0 |" in table
    assert "| colocated | measured | 5.0 | 5.5 | 0 | 9.0 | node 24 in 27.5 s | 0 |" in table
    assert "**WARNING: pd-always compiled programs during measured run 2**" in table


def test_the_servers_phases_of_a_run_are_their_means_per_request_over_that_run_only():
    """``load_phases`` reads what the engines' own histograms (``RequestPhases``) export: each phase's mean over the
    requests between two readings, by role, and a row per target and mix beside the client's mean TTFT."""
    import load_phases
    from prometheus_client import CollectorRegistry, generate_latest

    from fsm_pd.serving.request_phases import RequestPhases

    registries = CollectorRegistry(), CollectorRegistry()  # each engine its own; a pd process shows both
    prefill, decode = RequestPhases(registries[0], "prefill", "prefill-0"), RequestPhases(registries[1], "decode",
                                                                                          "decode-0")
    metrics = lambda: load_phases.parse("".join(generate_latest(r).decode() for r in registries))  # noqa: E731
    prefill.observe("queue", 1.0)  # before the run: not in its means
    before = metrics()
    for seconds in (0.010, 0.030):
        prefill.observe("queue", seconds)
        decode.observe("first_token", 2 * seconds)
    means = load_phases.means_ms(before, metrics())
    assert means == {"P queue": 20.0, "D first_token": 40.0}
    report = {"targets": {"pd-always": {"runs": [{"mixes": {"mixed": {"phases_ms": means, "ttft_mean_s": 0.0625}}}]}}}
    assert "| pd-always | mixed | 62.5 | P queue 20.0, D first_token 40.0 |" in load_phases.lines(report)


def test_handoffs_count_transfer_rooms_and_requests_served_whole_apart(tmp_path, monkeypatch):
    """What replay reads of a pd target's journals: a room with both sides is a handoff (Success on both, or not);
    a request served whole (auto's local route) leaves only a record of role ``local``, counted apart, never as a
    room without its Success (r16's table showed auto's 337 local requests as "337 rooms (0 Success)")."""
    import json
    import subprocess

    import load_targets

    (tmp_path / "prefill-0.db").touch()
    sides = [
        {"room": 1, "role": "prefill", "final": "Success", "time_in_state": {"Transferring": 0.0004}},
        {"room": 1, "role": "decode", "final": "Success", "time_in_state": {"Transferring": 0.0002}},
        {"room": 2, "role": "prefill", "final": "Failed", "time_in_state": {}},
        {"room": 2, "role": "decode", "final": "Failed", "time_in_state": {}},
        {"room": 3, "role": "local", "final": "Success", "time_in_state": {}},
        {"room": 4, "role": "local", "final": "Success", "time_in_state": {}},
    ]
    monkeypatch.setattr(load_targets.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a[0], 0, stdout=json.dumps({"rooms": sides}), stderr=""))
    report = load_targets.handoffs(tmp_path)
    assert (report["rooms"], report["success"], report["local"], report["consistent"]) == (2, 1, 2, True)
    assert report["prefill_xfer_ms"]["n"] == 1 and report["prefill_xfer_ms"]["p50"] == pytest.approx(0.4)
    line = load_report.handoff_lines({"targets": {"pd-auto": {"handoffs": report}}})[-1]
    assert line.startswith("| pd-auto | 2 (1) | 2 | ok | 0.40 / 0.40 / 0.40 | 0.20 / 0.20 / 0.20 |"), line


def test_the_step_loop_of_the_runs_is_the_difference_of_two_readings_and_its_longest_wait_only_where_it_grew():
    before = {"steps": 5, "busy_s": 1.0, "waits": 4, "waited_s": 0.1, "waited_max_s": 0.05, "idle_s": 2.0}
    after = {"steps": 9, "busy_s": 1.5, "waits": 7, "waited_s": 0.25, "waited_max_s": 0.05, "idle_s": 2.5}
    runs = step_loop_since(before, after)
    assert runs == {"steps": 4, "busy_s": 0.5, "waits": 3, "waited_s": 0.15, "idle_s": 0.5, "waited_max_s": None}
    assert step_loop_since(before, {**after, "waited_max_s": 0.08})["waited_max_s"] == 0.08
    assert step_loop_since(None, after) is None
    table = "\n".join(load_report.step_loop_lines({"targets": {"pd-auto": {"step_loop": runs}}}))
    assert "| pd-auto | 4 | 125.00 | 3, 50.00 / - | 0.50 |" in table
