"""A suite run's record as it goes, and its summary from that record alone: what ``tests/on_tpu.sh`` prints at the
end even when the run was cut short (its time limit, a hang, the host's own limit), because nothing is kept in
memory until pytest's own summary.

The plugin (``SuiteLog``, registered by tests/conftest.py where ``FSM_PD_SUITE_LOG`` names a file, which it then takes
out of the environment: a pytest that a test starts writes nothing there) appends one JSON line per event and flushes
it at once:

- ``{"event": "session", "name": ..., "t": ...}`` when the session starts;
- ``{"event": "start", "nodeid": ..., "t": ...}`` when a test starts (with xdist, when a worker says so);
- ``{"event": "result", "nodeid": ..., "outcome": ..., "seconds": ..., "message": ...}`` when a test is done: its
  outcome as pytest's summary counts it (passed, failed, error, skipped, xfailed, xpassed), its setup, call and
  teardown seconds together, and for a failure the first line of its error; where ``FSM_PD_SUITE_COMPILES`` is set,
  also the programs the test compiled (``compiles``: ``suite_compiles.py``);
- ``{"event": "finish", "exitstatus": ...}`` when the session ends (absent: the run was cut short).

Under pytest-xdist the controller writes the file: workers' reports reach it through the same hooks.

``python3 tests/suite_log.py LOG [LOG ...] [--slowest N] [--markdown PATH] [--json PATH]`` reads one or more such
files (``on_tpu.sh`` writes one for the chip's process and one for the CPU workers) and prints the counts, every
failure with its message, the tests still running when a run was cut, and the slowest tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import suite_compiles

ENV = "FSM_PD_SUITE_LOG"
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "interrupted")
NOT_PASSED = ("failed", "error", "xpassed", "interrupted")


class SuiteLog:
    """The pytest plugin: one JSON line per event, flushed as it happens."""

    def __init__(self, path: str | Path, name: str):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole session, closed at its end
        self.name = name
        self.tests: dict[str, dict] = {}  # nodeid -> what its reports said so far
        self.started: dict[str, float] = {}  # nodeid -> when it started, until it ends

    def write(self, **event) -> None:
        self.file.write(json.dumps({**event, "t": round(time.time(), 3)}) + "\n")
        self.file.flush()

    def pytest_sessionstart(self, session) -> None:
        self.write(event="session", name=self.name)

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        self.started[_plain(nodeid)] = time.monotonic()
        self.write(event="start", nodeid=_plain(nodeid))

    def pytest_runtest_logreport(self, report) -> None:
        test = self.tests.setdefault(_plain(report.nodeid), {"seconds": 0.0, "outcome": None, "message": ""})
        test["seconds"] += report.duration
        for name, spent in report.user_properties:  # the compiles of each phase (suite_compiles.py)
            if name == "compiles":
                test["compiles"] = suite_compiles.add(test.get("compiles"), spent)
        category = _category(report)
        if category in ("failed", "error", "xpassed") or (category and test["outcome"] is None):
            test["outcome"] = category
            if report.failed:
                test["message"] = _first_line(report)

    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        nodeid = _plain(nodeid)
        test = self.tests.pop(nodeid, None)
        self.started.pop(nodeid, None)
        if test is not None:
            extra = {"compiles": suite_compiles.rounded(test["compiles"])} if "compiles" in test else {}
            self.write(event="result", nodeid=nodeid, outcome=test["outcome"] or "passed",
                       seconds=round(test["seconds"], 3), message=test["message"], **extra)

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        for nodeid, began in list(self.started.items()):  # begun, never finished: Ctrl-C, or a worker that died
            test = self.tests.setdefault(nodeid, {"seconds": 0.0, "outcome": None, "message": ""})
            test["seconds"] = max(test["seconds"], time.monotonic() - began)
            if test["outcome"] not in NOT_PASSED:
                test["outcome"], test["message"] = "interrupted", "the run was stopped during this test"
            self.pytest_runtest_logfinish(nodeid, None)
        self.write(event="finish", exitstatus=int(exitstatus))
        self.file.close()


def _plain(nodeid: str) -> str:
    """The test's id without the ``@group`` that pytest-xdist's loadgroup appends (a parametrized id ends in ``]``)."""
    head, at, group = nodeid.rpartition("@")
    return head if at and "]" not in group else nodeid


def _category(report) -> str | None:
    """What pytest's summary counts a report as; None for a phase that passed outside the call."""
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed" if report.passed else "failed"
    if report.skipped:
        return "skipped"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return "passed" if report.when == "call" else None


def _first_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def read(paths: list[Path]) -> dict:
    """The runs the logs record: per log its name, whether it finished and how, its results, and its tests that
    started but have no result (still running when the run was cut)."""
    runs = []
    for path in paths:
        run = {"log": str(path), "name": path.stem, "finished": None, "results": {}, "running": {}, "began": None}
        if not path.exists():
            run["missing"] = True
            runs.append(run)
            continue
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a line cut off mid-write
                continue
            kind = event.get("event")
            if kind == "session":
                run["name"], run["began"] = event["name"], event["t"]
            elif kind == "start":
                run["running"][event["nodeid"]] = event["t"]
            elif kind == "result":
                run["running"].pop(event["nodeid"], None)
                run["results"][event["nodeid"]] = event
            elif kind == "finish":
                run["finished"] = event["exitstatus"]
        runs.append(run)
    return {"runs": runs}


def summary(record: dict, slowest: int = 15, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    counts = dict.fromkeys(OUTCOMES, 0)
    failures, running, durations = [], [], []
    for run in record["runs"]:
        for nodeid, result in run["results"].items():
            counts[result["outcome"]] = counts.get(result["outcome"], 0) + 1
            durations.append((result["seconds"], nodeid, run["name"]))
            if result["outcome"] in NOT_PASSED:
                failures.append({"nodeid": nodeid, "run": run["name"], "outcome": result["outcome"],
                                 "message": result["message"]})
        for nodeid, started in run["running"].items():
            running.append({"nodeid": nodeid, "run": run["name"], "seconds": round(now - started, 1)})
    durations.sort(reverse=True)
    compiled = {}  # per run, where its tests were counted (FSM_PD_SUITE_COMPILES): all its tests' compiles
    for run in record["runs"]:
        for result in run["results"].values():
            if "compiles" in result:
                compiled[run["name"]] = suite_compiles.add(compiled.get(run["name"]), result["compiles"])
    cut = [run["name"] for run in record["runs"] if run["finished"] is None]
    # exit status 5: that run collected nothing (a -k for the other run's tests), fine where the other ran tests
    ok = not failures and not running and not cut and any(run["results"] for run in record["runs"]) \
        and all(run["finished"] in (0, 5) for run in record["runs"])
    return {"counts": counts, "tests": sum(counts.values()), "failures": failures, "running": running,
            "cut_short": cut, "ok": ok, "compiles": {name: suite_compiles.rounded(c) for name, c in compiled.items()},
            "runs": {run["name"]: {"tests": len(run["results"]), "exitstatus": run["finished"]}
                     for run in record["runs"]},
            "slowest": [{"seconds": s, "nodeid": n, "run": r} for s, n, r in durations[:slowest]]}


def text(report: dict) -> str:
    counts = ", ".join(f"{n} {outcome}" for outcome, n in report["counts"].items() if n)
    runs = "; ".join(f"{name}: {run['tests']} tests, "
                     + ("cut short" if run["exitstatus"] is None else f"exit status {run['exitstatus']}")
                     for name, run in report["runs"].items())
    lines = [f"suite: {report['tests']} tests: {counts or 'none ran'} ({runs})"]
    for failure in report["failures"]:
        lines.append(f"{failure['outcome'].upper()} [{failure['run']}] {failure['nodeid']} - {failure['message']}")
    for test in report["running"]:
        lines.append(f"STILL RUNNING when cut [{test['run']}] {test['nodeid']} ({test['seconds']} s)")
    for name, c in report.get("compiles", {}).items():
        lines.append(f"compiles [{name}]: {c['programs']} programs ({c['cached']} from the compile cache), "
                     f"{c['loaded']} executables loaded; trace {c['trace_s']:.1f} s, lower {c['lower_s']:.1f} s, "
                     f"backend {c['backend_s']:.1f} s (per file: tests/suite_compiles.py)")
    if report["slowest"]:
        lines.append(f"slowest {len(report['slowest'])}:")
        lines += [f"  {t['seconds']:8.2f} s  [{t['run']}] {t['nodeid']}" for t in report["slowest"]]
    lines.append("suite: PASSED" if report["ok"] else "suite: NOT PASSED")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    out = ["| run | tests | exit status |", "| --- | ---: | --- |"]
    out += [f"| {name} | {run['tests']} | {'cut short' if run['exitstatus'] is None else run['exitstatus']} |"
            for name, run in report["runs"].items()]
    out += ["", "| outcome | tests |", "| --- | ---: |"]
    out += [f"| {outcome} | {n} |" for outcome, n in report["counts"].items() if n]
    if report["failures"] or report["running"]:
        out += ["", "| failed | run | message |", "| --- | --- | --- |"]
        out += [f"| `{f['nodeid']}` ({f['outcome']}) | {f['run']} | {f['message'].replace('|', '/')} |"
                for f in report["failures"]]
        out += [f"| `{t['nodeid']}` (still running, {t['seconds']} s) | {t['run']} | |" for t in report["running"]]
    if report["slowest"]:
        out += ["", "| slowest | run | s |", "| --- | --- | ---: |"]
        out += [f"| `{t['nodeid']}` | {t['run']} | {t['seconds']:.2f} |" for t in report["slowest"]]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The summary of suite logs (tests/suite_log.py)")
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--slowest", type=int, default=15)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report = summary(read(args.logs), args.slowest)
    print(text(report))
    if args.markdown:
        args.markdown.write_text(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
