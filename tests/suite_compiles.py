"""What each test cost in programs: how many its process compiled while it ran, and the seconds spent tracing,
lowering and compiling them. On a TPU host the chip half's time is mostly that (a small program is 0.3 to 2 s to
compile there, a model step with the Pallas kernels several), so the counts say where its minutes go, and the CPU's
counts are the proxy for the chip's where no chip is at hand (the CPU compiles at -O0 in the suite: its seconds
understate the chip's).

``FSM_PD_SUITE_COMPILES=1`` (``tests/on_tpu.sh`` sets it) installs ``CompileCounter`` in every process that runs
tests (tests/conftest.py). It listens to ``jax.monitoring`` from the first test after jax is imported (process-wide:
the compiles of a test's engine threads count for the test) and adds each test's share to its reports, which
``suite_log.py`` writes into the test's ``result`` event as ``compiles``:

- ``programs``: XLA compiles asked for (jax's backend-compile event), ``cached`` of them read back from the
  persistent compile cache (the chip's run has one: a program compiled again in that process costs its trace,
  lowering and the cache's read, not XLA's compile);
- ``loaded``: programs loaded whole from fsm-pd's executable store (``fsm_pd/model/executables.py``: no trace,
  lowering or compile; on by default on an accelerator), which jax does not report;
- ``trace_s``, ``lower_s``, ``backend_s``, ``load_s``: seconds in each;
- with ``FSM_PD_SUITE_COMPILES=names``, ``names``: each program's name and backend seconds, in order (which programs
  a test compiles, and which it compiles again).

A module-scoped fixture's programs count for the first test that uses it; programs compiled at collection (a module
that compiles on import) count for none.

``python3 tests/suite_compiles.py LOG [LOG ...] [--tests N]`` prints them per file and the tests that compiled most.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import defaultdict
from pathlib import Path

import pytest

ENV = "FSM_PD_SUITE_COMPILES"
FIELDS = ("programs", "cached", "loaded", "trace_s", "lower_s", "backend_s", "load_s")
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND = "/jax/core/compile/backend_compile_duration"  # around the persistent cache's lookup too
_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # on the compiling thread, before its backend event


class CompileCounter:
    """The pytest plugin: each report carries the compiles since the one before (``("compiles", {...})`` in its
    ``user_properties``, which pytest-xdist sends on to the controller's ``suite_log.SuiteLog``)."""

    def __init__(self, names: bool = False):
        self._names: list[str] | None = [] if names else None
        self._lock = threading.Lock()
        self._local = threading.local()
        self._totals = dict.fromkeys(FIELDS, 0.0)
        self._listening = False
        self._last = self.snapshot()

    def _listen(self) -> None:
        """Listen once jax is imported, and not before: a run whose tests use no jax (the suite's own throwaway
        suites) does not start it for this."""
        if self._listening or "jax" not in sys.modules:
            return
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        self._listening = True

    def _on_event(self, event: str, **_) -> None:
        if event == _CACHE_HIT:
            self._local.hit = True

    def _on_duration(self, event: str, seconds: float, fun_name: str = "?", **_) -> None:
        field = {_TRACE: "trace_s", _LOWER: "lower_s", _BACKEND: "backend_s"}.get(event)
        if field is None:
            return
        with self._lock:
            self._totals[field] += seconds
            if event == _BACKEND:
                hit = getattr(self._local, "hit", False)
                self._totals["programs"] += 1
                self._totals["cached"] += hit
                self._local.hit = False
                if self._names is not None:
                    self._names.append(f"{fun_name}{' (cached)' if hit else ''} {seconds:.2f}")

    def snapshot(self) -> dict[str, float]:
        # fsm-pd counts its executable store's loads, which jax does not see (none where it is not imported)
        compiles = sys.modules.get("fsm_pd.model.compiles")
        stored = compiles.costs().values() if compiles is not None else ()
        with self._lock:
            return {**self._totals, "loaded": sum(c.from_executable for c in stored),
                    "load_s": sum(c.load_s for c in stored)}

    def pytest_collection_finish(self, session) -> None:
        self._listen()
        self._last = self.snapshot()  # what collection compiled is no test's

    def pytest_runtest_setup(self, item) -> None:
        self._listen()  # jax imported since (a compile before this is not counted)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        now = self.snapshot()
        spent = {field: now[field] - self._last[field] for field in FIELDS}
        self._last = now
        if self._names:
            with self._lock:
                spent["names"], self._names = self._names, []
        if any(spent.values()):
            outcome.get_result().user_properties.append(("compiles", spent))


def add(into: dict | None, spent: dict) -> dict:
    """``into`` with ``spent`` added, field by field (a test's phases, a file's tests)."""
    into = dict.fromkeys(FIELDS, 0.0) if into is None else into
    for field in FIELDS:
        into[field] = into.get(field, 0.0) + spent.get(field, 0.0)
    if spent.get("names"):
        into["names"] = into.get("names", []) + list(spent["names"])
    return into


def rounded(spent: dict) -> dict:
    out = {field: int(spent[field]) if field in ("programs", "cached", "loaded") else round(spent[field], 3)
           for field in FIELDS}
    return out | ({"names": spent["names"]} if spent.get("names") else {})


def per_file(paths: list[Path]) -> tuple[dict[str, dict], list[tuple[str, dict]]]:
    """From suite logs: each test file's compiles with its tests' seconds (``seconds``) and count (``tests``), and
    every test's that compiled anything."""
    files: dict[str, dict] = defaultdict(lambda: {**dict.fromkeys(FIELDS, 0.0), "seconds": 0.0, "tests": 0})
    tests = []
    for path in paths:
        for line in (path.read_text() if path.exists() else "").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") != "result":
                continue
            file = files[event["nodeid"].split("::")[0]]
            file["seconds"] += event["seconds"]
            file["tests"] += 1
            if event.get("compiles"):
                add(file, event["compiles"])
                tests.append((event["nodeid"], {**event["compiles"], "seconds": event["seconds"]}))
    return dict(files), tests


def table(files: dict[str, dict], tests: list[tuple[str, dict]], top: int = 20) -> str:
    head = f"{'programs':>8} {'cached':>6} {'loaded':>6} {'trace s':>7} {'lower s':>7} {'backend s':>9} {'test s':>7}"
    row = lambda c: (f"{int(c['programs']):8d} {int(c['cached']):6d} {int(c['loaded']):6d} {c['trace_s']:7.1f} "
                     f"{c['lower_s']:7.1f} {c['backend_s']:9.1f} {c['seconds']:7.1f}")
    lines = [f"{head}  file (tests)"]
    for name, c in sorted(files.items(), key=lambda kv: -kv[1]["programs"]):
        lines.append(f"{row(c)}  {name} ({c['tests']})")
    total = add(None, {})
    for c in files.values():
        add(total, c)
    total["seconds"] = sum(c["seconds"] for c in files.values())
    lines.append(f"{row(total)}  all {sum(c['tests'] for c in files.values())} tests")
    if top:
        lines += ["", f"{head}  test ({top} that compiled most)"]
        lines += [f"{row(c)}  {nodeid}" for nodeid, c in sorted(tests, key=lambda t: -t[1]["programs"])[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Programs compiled per test file, from suite logs "
                                                 "(tests/suite_compiles.py)")
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--tests", type=int, default=20, help="the N tests that compiled most (0: none)")
    args = parser.parse_args(argv)
    print(table(*per_file(args.logs), top=args.tests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
