"""Fault injection: ``FSM_PD_FAULT_*`` parsing and each hook (``fsm_pd/effects/faults.py``)."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import generate_latest

from fsm_pd.control.metrics import NodeMetrics
from fsm_pd.effects.faults import CRASH_EXIT_CODE, CRASH_POINTS, FaultConfig, Faults, InjectedFault


def test_off_by_default():
    config = FaultConfig.from_env({"PATH": "/bin", "FSM_PD_WAITING_TIMEOUT": "3"})
    assert not config.enabled and config.describe() == {}
    faults = Faults(config)
    for stage in ("gather", "publish", "pull", "scatter"):
        faults.check(stage)
    assert faults.message("READY") == 0.0 and faults.pull_delay_s == 0.0
    faults.crash("after_publish")  # nothing happens
    assert faults.counters() == {}


def test_parses_every_variable():
    config = FaultConfig.from_env(
        {
            "FSM_PD_FAULT_GATHER": "0.1",
            "FSM_PD_FAULT_PUBLISH": "0",
            "FSM_PD_FAULT_PULL": "1",
            "FSM_PD_FAULT_SCATTER": " 0.5 ",
            "FSM_PD_FAULT_DROP_MESSAGE": "0.3",
            "FSM_PD_FAULT_DELAY_MESSAGE_S": "2",
            "FSM_PD_FAULT_DELAY_MESSAGE_P": "0.25",
            "FSM_PD_FAULT_MESSAGES": "ready, pulled",
            "FSM_PD_FAULT_PULL_DELAY_S": "1.5",
            "FSM_PD_FAULT_CRASH_AT": "before_scatter",
            "FSM_PD_FAULT_SEED": "7",
        }
    )
    assert config.enabled
    assert dict(config.stages) == {"gather": 0.1, "pull": 1.0, "scatter": 0.5}  # a zero is simply off
    assert (config.drop_message, config.delay_message_s, config.delay_message_p) == (0.3, 2.0, 0.25)
    assert config.messages == {"READY", "PULLED"} and config.pull_delay_s == 1.5
    assert config.crash_at == "before_scatter" and config.seed == 7
    assert config.describe()["messages"] == ["PULLED", "READY"]


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"FSM_PD_FAULT_PUL": "0.1"}, "unknown fault variable"),
        ({"FSM_PD_FAULT_PULL": "1.5"}, "probability in [0, 1]"),
        ({"FSM_PD_FAULT_PULL": "often"}, "not a probability"),
        ({"FSM_PD_FAULT_DROP_MESSAGE": "-0.1"}, "probability in [0, 1]"),
        ({"FSM_PD_FAULT_DELAY_MESSAGE_S": "-1"}, "must not be negative"),
        ({"FSM_PD_FAULT_PULL_DELAY_S": "soon"}, "number of seconds"),
        ({"FSM_PD_FAULT_CRASH_AT": "sometime"}, "not a crash point"),
        ({"FSM_PD_FAULT_MESSAGES": "READY,HELLO"}, "unknown kind"),
        ({"FSM_PD_FAULT_SEED": "x"}, "not an integer"),
    ],
)
def test_rejects_bad_settings(env, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        FaultConfig.from_env(env)


def test_stage_failure_says_it_was_injected():
    faults = Faults(FaultConfig.from_env({"FSM_PD_FAULT_PULL": "1"}), role="decode")
    with pytest.raises(InjectedFault, match=r"^injected fault: pull failed \(FSM_PD_FAULT_PULL=1\)$"):
        faults.check("pull")
    faults.check("scatter")  # other stages untouched
    assert faults.counters() == {"pull": 1}


def test_probability_is_honoured_and_seeded():
    def run(seed):
        faults = Faults(FaultConfig.from_env({"FSM_PD_FAULT_GATHER": "0.2", "FSM_PD_FAULT_SEED": str(seed)}))
        hits = []
        for _ in range(2000):
            try:
                faults.check("gather")
                hits.append(0)
            except InjectedFault:
                hits.append(1)
        return hits

    first = run(3)
    assert first == run(3), "the same seed gives the same faults"
    assert 300 < sum(first) < 500


def test_messages_dropped_delayed_or_sent():
    drop = Faults(FaultConfig.from_env({"FSM_PD_FAULT_DROP_MESSAGE": "1", "FSM_PD_FAULT_MESSAGES": "READY"}))
    assert drop.message("READY") is None and drop.message("PREPARE") == 0.0
    delay = Faults(FaultConfig.from_env({"FSM_PD_FAULT_DELAY_MESSAGE_S": "0.5"}))
    assert delay.message("PULLED") == 0.5 and delay.counters() == {"delay:PULLED": 1}
    never = Faults(FaultConfig.from_env({"FSM_PD_FAULT_DELAY_MESSAGE_S": "0.5", "FSM_PD_FAULT_DELAY_MESSAGE_P": "0"}))
    assert never.message("PULLED") == 0.0


def test_later_runs_the_action_after_the_delay():
    done, ran = threading.Event(), []
    scheduled = time.monotonic()
    Faults().later(0.05, lambda: (ran.append(time.monotonic()), done.set()))
    assert done.wait(10)
    assert ran[0] - scheduled >= 0.05  # a timer never fires early, however slow the machine: no margin to miss


def test_crash_exits_only_at_its_point(capsys):
    exits = []
    faults = Faults(FaultConfig.from_env({"FSM_PD_FAULT_CRASH_AT": "after_publish"}), exit=exits.append)
    faults.crash("before_gather")
    assert exits == []
    faults.crash("after_publish")
    assert exits == [CRASH_EXIT_CODE]
    assert "crashing the prefill process at after_publish" in capsys.readouterr().err


def test_crash_points_are_distinct_per_role():
    prefill, decode = set(CRASH_POINTS["prefill"]), set(CRASH_POINTS["decode"])
    assert not prefill & decode and {"after_publish", "before_scatter"} <= prefill | decode


def test_leak_gauges_are_read_at_scrape_time():
    class FakeNode:
        role, node_id, states, observers = "decode", "decode-9", {}, []

    metrics = NodeMetrics(FakeNode())
    values = {"pages_free": 10, "pages_reserved": 2, "open_transfer_entries": 0, "staging_buffers_held": None}
    metrics.watch_leaks(lambda: values)
    text = generate_latest(metrics.registry).decode()
    assert 'fsm_pd_kv_pages_free{node="decode-9",role="decode"} 10.0' in text
    assert 'fsm_pd_kv_pages_reserved{node="decode-9",role="decode"} 2.0' in text
    assert "fsm_pd_staging_buffers_held" not in text  # None: not this role's
    values["pages_reserved"] = 0
    assert 'fsm_pd_kv_pages_reserved{node="decode-9",role="decode"} 0.0' in generate_latest(metrics.registry).decode()


def test_pause_file_turns_every_hook_off(tmp_path):
    pause = tmp_path / "pause"
    pause.touch()
    env = {
        "FSM_PD_FAULT_PULL": "1",
        "FSM_PD_FAULT_DROP_MESSAGE": "1",
        "FSM_PD_FAULT_PULL_DELAY_S": "3",
        "FSM_PD_FAULT_CRASH_AT": "before_pull",
        "FSM_PD_FAULT_PAUSE_FILE": str(pause),
    }
    exits = []
    faults = Faults(FaultConfig.from_env(env), role="decode", exit=exits.append)
    faults.check("pull")
    faults.crash("before_pull")
    assert faults.message("READY") == 0.0 and faults.pull_delay_s == 0.0 and exits == []
    pause.unlink()
    with pytest.raises(InjectedFault):
        faults.check("pull")
    assert faults.message("READY") is None and faults.pull_delay_s == 3.0
    faults.crash("before_pull")
    assert exits == [CRASH_EXIT_CODE]


def _replace(path, text: str) -> None:
    """Write the fault file whole, as a drill does: another file renamed over it."""
    new = path.with_suffix(".new")
    new.write_text(text)
    new.replace(path)


def test_a_fault_file_is_read_over_the_environment_and_again_when_it_changes(tmp_path, caplog):
    path = tmp_path / "faults"
    env = {"FSM_PD_FAULT_FILE": str(path), "FSM_PD_FAULT_GATHER": "1", "FSM_PD_FAULT_SEED": "5"}
    faults = Faults(FaultConfig.from_env(env))  # no file yet: the environment's settings alone
    with pytest.raises(InjectedFault):
        faults.check("gather")
    _replace(path, "# a drill\nFSM_PD_FAULT_GATHER = 0\nFSM_PD_FAULT_PUBLISH=1\n")
    faults.check("gather")  # the file's 0 over the environment's 1
    with pytest.raises(InjectedFault, match=r"FSM_PD_FAULT_PUBLISH=1\)$"):
        faults.check("publish")
    assert faults.config.seed == 5 and faults.config.describe() == {"fail_publish": 1.0}
    _replace(path, "FSM_PD_FAULT_CRASH_AT=after_publish\nFSM_PD_FAULT_PULL_DELAY_S=2\n")
    assert faults.config.describe() == {"fail_gather": 1.0, "pull_delay_s": 2.0, "crash_at": "after_publish"}
    _replace(path, "FSM_PD_FAULT_PULL_DELAY_S=soon\n")  # a typo while it runs: said, and nothing changes
    assert faults.pull_delay_s == 2.0
    assert "not taken" in caplog.text and "number of seconds" in caplog.text
    path.unlink()  # gone: the environment's settings again
    assert faults.config.describe() == {"fail_gather": 1.0} and faults.counters() == {"gather": 1, "publish": 1}


@pytest.mark.parametrize("text, words", [("FSM_PD_FAULT_PULL=2\n", "probability in [0, 1]"),
                                         ("PULL=1\n", "line 1: not a FSM_PD_FAULT_NAME=value"),
                                         ("FSM_PD_FAULT_PAUSE_FILE=/x\n", "not a FSM_PD_FAULT_NAME=value")])
def test_a_bad_fault_file_is_an_error_at_start(tmp_path, text, words):
    path = tmp_path / "faults"
    path.write_text(text)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        FaultConfig.from_env({"FSM_PD_FAULT_FILE": str(path)})
