"""The suite's record as it goes (``tests/suite_log.py``) and ``tests/on_tpu.sh`` around it: every outcome is
recorded as the test ends, under xdist as in one process, and the summary read from the record alone names the
failures, the tests a cut-short run was still running, and the slowest tests. ``on_tpu.sh`` runs the ``chip`` tests
in one process and the rest on CPU workers at the same time, and ends with that summary whatever ends it: its time
limit or a signal from outside. Checked on throwaway suites with this project's pyproject.toml and conftest.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import suite_compiles
import suite_log

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ("conftest.py", "real_parts.py", "on_chip.py", "node_sockets.py", "suite_log.py", "suite_compiles.py",
           "xla_flags.py", "httpx_ssl.py", "bytecode.py", "on_tpu.sh")

OUTCOMES = '''
import time
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 + 1 == 3, "arithmetic broke"

@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")

def test_errors(broken):
    pass

def test_skips():
    pytest.skip("not here")

@pytest.mark.xfail(reason="known", strict=True)
def test_xfails():
    assert False

def test_slow():
    time.sleep(0.4)
'''


def throwaway(tmp_path: Path, tests: dict[str, str]) -> Path:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "property").mkdir()
    for helper in HELPERS:
        shutil.copy(ROOT / "tests" / helper, tmp_path / "tests" / helper)
    for name, text in tests.items():
        (tmp_path / "tests" / "unit" / name).write_text(text)
    return tmp_path


def environ(**extra: str) -> dict[str, str]:
    # only the plugins under test: the others this environment installs (schemathesis, hypothesis) load slowly. The
    # PYTHONPATH this run has stays behind the project's: a TPU host's Python may find pytest-xdist and pytest-timeout
    # only there (PYTHONPATH=/tmp/site). XLA's flags as given: these suites run no jax, which the suite's own flags
    # would start (tests/xla_flags.py)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FSM_PD_REQUIRE", "FSM_PD_ALLOW", "FSM_PD_SUITE", "PYTEST_"))}
    path = os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    return env | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": path, "FSM_PD_SUITE_XLA_DEFAULTS": "1", **extra}


PLUGINS = ["-p", "pytest_timeout", "-p", "xdist.plugin"]


def test_each_outcome_is_recorded_as_pytest_counts_it_in_one_process_and_on_workers(tmp_path):
    root = throwaway(tmp_path, {"test_outcomes.py": OUTCOMES})
    for name, spread in (("serial", []), ("workers", ["-n", "2"])):
        log = tmp_path / f"{name}.jsonl"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PLUGINS, *spread,
                               "tests/unit"], cwd=root, env=environ(FSM_PD_SUITE_LOG=str(log)), capture_output=True,
                              text=True, timeout=120)
        assert "1 failed, 2 passed, 1 skipped, 1 xfailed, 1 error" in done.stdout, done.stdout + done.stderr
        report = suite_log.summary(suite_log.read([log]))
        assert {k: v for k, v in report["counts"].items() if v} == {
            "passed": 2, "failed": 1, "error": 1, "skipped": 1, "xfailed": 1}, (name, report)
        messages = {f["nodeid"].rsplit("::")[-1]: (f["outcome"], f["message"]) for f in report["failures"]}
        assert messages["test_fails"][0] == "failed" and "arithmetic broke" in messages["test_fails"][1]
        assert messages["test_errors"] == ("error", "RuntimeError: the fixture broke")
        assert report["slowest"][0]["nodeid"].endswith("::test_slow") and report["slowest"][0]["seconds"] >= 0.4
        assert report["runs"] == {name: {"tests": 6, "exitstatus": 1}} and not report["ok"]
        assert not report["running"] and not report["cut_short"]


NESTED = '''
import subprocess
import sys

def test_starts_a_pytest_of_its_own():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_timeout",
                           "-p", "xdist.plugin", "tests/property/test_inner.py"], capture_output=True, text=True,
                          timeout=120)
    assert "1 passed" in done.stdout, done.stdout + done.stderr
'''


def test_a_pytest_a_test_starts_writes_nothing_into_the_run_s_record(tmp_path):
    """The suite's own tests run throwaway suites: their tests are not the run's (they once showed up as its
    failures), in one process or on workers."""
    root = throwaway(tmp_path, {"test_nested.py": NESTED})
    (root / "tests" / "property" / "test_inner.py").write_text("def test_inner():\n    pass\n")
    for name, spread in (("serial", []), ("workers", ["-n", "2"])):
        log = tmp_path / f"{name}.jsonl"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PLUGINS, *spread,
                               "tests/unit"], cwd=root, env=environ(FSM_PD_SUITE_LOG=str(log)), capture_output=True,
                              text=True, timeout=120)
        assert "1 passed" in done.stdout, done.stdout + done.stderr
        events = [json.loads(line) for line in log.read_text().splitlines()]
        assert [e.get("nodeid") for e in events if e["event"] == "result"] == [
            "tests/unit/test_nested.py::test_starts_a_pytest_of_its_own"], (name, events)
        assert [e["event"] for e in events if e["event"] in ("session", "finish")] == ["session", "finish"], name


COMPILES = '''
import jax

def test_compiles_two_programs():
    jax.jit(lambda x: x + 1)(1)
    jax.jit(lambda x: x * 2)(1.5)

def test_compiles_nothing():
    pass
'''


def test_each_test_s_compiles_are_recorded_with_it_in_one_process_and_on_workers(tmp_path):
    """FSM_PD_SUITE_COMPILES=1: each test's result carries the programs its process compiled while it ran
    (suite_compiles.py), counted where the test ran and written by the run's record."""
    root = throwaway(tmp_path, {"test_compiles.py": COMPILES})
    for name, spread in (("serial", []), ("workers", ["-n", "2"])):
        log = tmp_path / f"{name}.jsonl"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PLUGINS, *spread,
                               "tests/unit"], cwd=root, env=environ(FSM_PD_SUITE_LOG=str(log),
                                                                    FSM_PD_SUITE_COMPILES="names"),
                              capture_output=True, text=True, timeout=120)
        assert "2 passed" in done.stdout, done.stdout + done.stderr
        results = {e["nodeid"].rsplit("::")[-1]: e for e in map(json.loads, log.read_text().splitlines())
                   if e["event"] == "result"}
        spent = results["test_compiles_two_programs"]["compiles"]
        assert spent["programs"] == 2 and spent["cached"] == 0 and spent["backend_s"] > 0, (name, spent)
        assert [n.split()[0] for n in spent["names"]] == ["jit(<lambda>)"] * 2
        assert "compiles" not in results["test_compiles_nothing"], name
        report = suite_log.summary(suite_log.read([log]))
        assert report["compiles"][name]["programs"] == 2
        assert f"compiles [{name}]: 2 programs (0 from the compile cache)" in suite_log.text(report)
        files, tests = suite_compiles.per_file([log])
        assert files["tests/unit/test_compiles.py"]["programs"] == 2 and len(tests) == 1
        assert "tests/unit/test_compiles.py (2)" in suite_compiles.table(files, tests)


def test_a_run_cut_mid_test_names_the_test_it_was_running(tmp_path):
    """A killed process writes nothing more: what its record holds so far is the summary."""
    root = throwaway(tmp_path, {"test_hang.py": "import time\n\ndef test_quick():\n    pass\n\n"
                                               "def test_hangs():\n    time.sleep(600)\n"})
    log = tmp_path / "chip.jsonl"
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PLUGINS, "tests/unit"],
                           cwd=root, env=environ(FSM_PD_SUITE_LOG=str(log)), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)  # its output is not read: it would fill the pipe
    try:
        deadline = time.monotonic() + 60
        while "test_hangs" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            assert run.poll() is None, f"the run ended with {run.returncode} before test_hangs started"
            time.sleep(0.1)
    finally:
        run.kill()  # SIGKILL: no session end, no pytest summary
        run.wait()
    report = suite_log.summary(suite_log.read([log]))
    assert report["counts"]["passed"] == 1 and report["cut_short"] == ["chip"] and not report["ok"]
    assert [t["nodeid"] for t in report["running"]] == ["tests/unit/test_hang.py::test_hangs"]
    assert "STILL RUNNING when cut [chip] tests/unit/test_hang.py::test_hangs" in suite_log.text(report)


ON_TPU = '''
import os
import time
import pytest

def test_cpu_side_fails():
    assert os.environ.get("JAX_PLATFORMS") == "cpu"  # the CPU workers never open the chip
    assert False, "a CPU test failed"

def test_cpu_side_passes():
    pass

@pytest.mark.chip
def test_chip_side_passes():
    assert os.environ.get("JAX_PLATFORMS") != "cpu"  # this process may take the chip

@pytest.mark.chip
def test_chip_side_hangs():
    time.sleep(600)
'''


# A module without chip tests: the chip's run does not even import it (it collects only the files that name the
# mark), so this one fails to import there and nowhere else.
CPU_ONLY = '''
import os

assert os.environ.get("JAX_PLATFORMS") == "cpu", "imported by the chip's run"

def test_in_a_file_without_chip_tests():
    pass
'''


def on_tpu(tmp_path: Path, *, limit: int, stop=None) -> tuple[int, str]:
    root = throwaway(tmp_path, {"test_split.py": ON_TPU, "test_cpu_only.py": CPU_ONLY})
    out = tmp_path / "out"
    # the CPU half at this run's own priority (on_tpu.sh's nice 10 is for a TPU host, where the chip half is the
    # longer): beside this machine's other tests a niced CPU half would wait longer for the 15 s limit below
    env = environ(FSM_PD_SUITE_LIMIT=str(limit), FSM_PD_SUITE_WORKERS="2", FSM_PD_SUITE_OUT=str(out),
                  FSM_PD_SUITE_COMPILE_CACHE=str(tmp_path / "jax"), FSM_PD_SUITE_NO_CHIP="1", FSM_PD_SUITE_CPU_NICE="0")
    env.pop("JAX_PLATFORMS", None)  # the chip half as on_tpu.sh starts it; the chip itself stays the outer run's
    run = subprocess.Popen(["bash", "tests/on_tpu.sh", *PLUGINS], cwd=root, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    if stop is not None:
        stop(run, out)
    text, _ = run.communicate(timeout=120)
    assert json.loads((out / "summary.json").read_text())["failures"], text  # written beside the printed summary
    return run.returncode, text


def test_on_tpu_sh_runs_both_halves_at_once_and_ends_with_its_summary_at_its_limit(tmp_path):
    # The limit is waited out (the chip half hangs): 15 s, room for the CPU half to finish first on a loaded machine
    # (it ended 7 s after its start beside another 2-worker run and a load of 5 on 2 cores; 25 s waited 10 s more)
    status, text = on_tpu(tmp_path, limit=15)
    assert status == 1, text
    assert "suite: 5 tests: 3 passed, 1 failed, 1 interrupted" in text, text
    assert "FAILED [cpu] tests/unit/test_split.py::test_cpu_side_fails - AssertionError: a CPU test failed" in text
    assert "INTERRUPTED [chip] tests/unit/test_split.py::test_chip_side_hangs - the run was stopped" in text
    hung = json.loads((tmp_path / "out" / "summary.json").read_text())["slowest"][0]
    assert hung["nodeid"].endswith("::test_chip_side_hangs") and hung["seconds"] > 5  # the time it hung, counted
    assert "slowest 5:" in text
    assert text.rstrip().endswith("pytest exit status chip 124, cpu 1")  # 124: `timeout` cut it at the limit


def test_on_tpu_sh_ends_with_its_summary_when_stopped_from_outside(tmp_path):
    def when_the_chip_test_hangs(run, out):
        deadline = time.monotonic() + 60
        log = out / "chip.jsonl"
        while "test_chip_side_hangs" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and run.poll() is None
            time.sleep(0.2)
        cpu = out / "cpu.jsonl"
        while '"finish"' not in (cpu.read_text() if cpu.exists() else ""):  # the CPU half has ended
            assert time.monotonic() < deadline and run.poll() is None
            time.sleep(0.2)
        run.send_signal(signal.SIGTERM)  # as an outer `timeout` does

    status, text = on_tpu(tmp_path, limit=300, stop=when_the_chip_test_hangs)
    assert status == 1, text
    assert "INTERRUPTED [chip] tests/unit/test_split.py::test_chip_side_hangs" in text, text
    assert "FAILED [cpu] tests/unit/test_split.py::test_cpu_side_fails" in text and "suite: NOT PASSED" in text
