"""The suite's own settings do what pyproject.toml and tests/conftest.py say: a test that runs past its timeout
fails (and the run goes on), and a real-part test that skips is reported, and fails the session where CI requires
real parts (``tests/real_parts.py``). Checked on throwaway suites run by a fresh pytest with this project's
pyproject.toml and conftest.py."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

from xla_flags import CHEAP_COMPILE, FAST_COMPILE, for_cold_starts

ROOT = Path(__file__).resolve().parents[2]

TIMEOUTS = '''
import time
import pytest

def test_quick():
    pass

@pytest.mark.timeout(1)
def test_hangs():
    time.sleep(60)
'''

REAL_PARTS = '''
import pytest

@pytest.mark.real_part("here", missing=None)
def test_uses_a_part_that_is_here():
    pass

@pytest.mark.real_part("gone", missing="gone is not installed (apt-get install gone)")
def test_uses_a_part_that_is_missing():
    raise AssertionError("must not run: its part is missing")

@pytest.mark.real_part("here", missing=None)
@pytest.mark.real_part("netlike")
def test_finds_out_itself_that_its_part_is_missing():
    pytest.skip("cannot build namespaces here")

def test_without_parts():
    pytest.skip("an ordinary skip counts against no part")
'''


XLA = '''
import os, subprocess, sys

# the optimization level XLA parsed from XLA_FLAGS for this process (jax's own binding: XLA reads the flags once)
LEVEL = ("from jax._src.lib import _jax; "
         "print(_jax.CompileOptions().executable_build_options.debug_options.xla_backend_optimization_level)")

def test_reads_its_level_and_a_childs():
    from jax._src.lib import _jax

    level = _jax.CompileOptions().executable_build_options.debug_options.xla_backend_optimization_level
    child = subprocess.run([sys.executable, "-c", LEVEL], capture_output=True, text=True, check=True).stdout.strip()
    with open("levels.txt", "w") as out:  # in the run's directory: a worker's prints do not reach its output
        out.write(f"here [{level}] child [{child}] flags [{os.environ['XLA_FLAGS']}]")
'''


def run_suite(tmp_path: Path, tests: str, *args: str, **env: str) -> tuple[int, str]:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "tests").mkdir(exist_ok=True)
    for helper in ("conftest.py", "real_parts.py", "on_chip.py", "node_sockets.py", "suite_log.py", "xla_flags.py",
                   "httpx_ssl.py", "bytecode.py", "suite_compiles.py"):
        shutil.copy(ROOT / "tests" / helper, tmp_path / "tests" / helper)
    (tmp_path / "tests" / "test_throwaway.py").write_text(tests)
    # only the plugins under test (pyproject's addopts name xdist's --dist): the others this environment installs
    # (schemathesis, hypothesis) load slowly
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("FSM_PD_REQUIRE", "FSM_PD_ALLOW", "PYTEST_"))}
    # and XLA's flags as given: these suites run no jax, unless a test asks (the suite's flags start jax at once)
    environ |= {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "FSM_PD_SUITE_XLA_DEFAULTS": "1", **env}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "pytest_timeout", "-p", "xdist.plugin",
                           "-p", "no:cacheprovider", *args],
                          cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def test_a_test_past_its_timeout_fails_and_the_run_goes_on(tmp_path):
    _, out = run_suite(tmp_path, TIMEOUTS)
    assert "Timeout" in out and "FAILED tests/test_throwaway.py::test_hangs" in out
    assert "1 failed, 1 passed" in out


def test_on_a_cpu_tests_compile_at_o0_and_the_processes_they_start_at_o1(tmp_path):
    """tests/conftest.py: the process that runs tests compiles with xla_flags.FAST_COMPILE (-O0), the processes its
    tests start inherit the flags the run was given and CHEAP_COMPILE (-O1); on xdist workers too. With a shared
    compile cache, CHEAP_COMPILE everywhere; FSM_PD_SUITE_XLA_DEFAULTS=1 leaves the flags as given (XLA's -O3)."""
    given = "--xla_force_host_platform_device_count=3"
    env = {"XLA_FLAGS": given, "JAX_PLATFORMS": "cpu", "FSM_PD_SUITE_XLA_DEFAULTS": "0",
           "FSM_PD_SUITE_COMPILE_CACHE": ""}  # none, unless a case says (tests/on_tpu.sh sets one for its runs)

    def levels(*args: str, **more: str) -> str:
        status, out = run_suite(tmp_path, XLA, *args, **{**env, **more})
        assert status == 0, out
        return (tmp_path / "levels.txt").read_text()

    children = f"flags [{given} {CHEAP_COMPILE}]"
    assert levels() == f"here [0] child [1] {children}"
    assert levels("-n", "1") == f"here [0] child [1] {children}"
    assert levels(FSM_PD_SUITE_COMPILE_CACHE=str(tmp_path / "jax")) == f"here [1] child [1] {children}"
    assert levels(FSM_PD_SUITE_XLA_DEFAULTS="1") == f"here [3] child [3] flags [{given}]"


def test_nodes_watched_compiling_get_o0_where_the_suite_gave_o1():
    """xla_flags.for_cold_starts: the processes tests start have CHEAP_COMPILE (-O1) on a CPU; a node a test starts to
    watch it compile gets FAST_COMPILE (-O0) instead, beside the flags the run was given; flags the suite did not set
    (a chip host's, FSM_PD_SUITE_XLA_DEFAULTS=1) stay as they are."""
    given = "--xla_force_host_platform_device_count=3"
    assert for_cold_starts(f"{given} {CHEAP_COMPILE}") == f"{given} {FAST_COMPILE}"
    assert for_cold_starts(given) == given
    assert for_cold_starts("") == ""


def test_real_part_skips_are_reported_and_fail_nothing_by_default(tmp_path):
    status, out = run_suite(tmp_path, REAL_PARTS)
    assert status == 0, out
    assert "1 passed, 3 skipped" in out
    assert "real parts: gone skipped 1, here ran 1, netlike skipped 1\n" in out
    assert "real part gone missing: gone is not installed (apt-get install gone)" in out  # -ra lists the reason


def test_where_real_parts_are_required_a_skip_fails_the_session_unless_allowed(tmp_path):
    status, out = run_suite(tmp_path, REAL_PARTS, FSM_PD_REQUIRE_REAL_PARTS="1")
    assert status == 1, out
    assert "real parts: gone skipped 1, here ran 1, netlike skipped 1\n" in out
    assert "real part gone skipped but FSM_PD_REQUIRE_REAL_PARTS=1 and FSM_PD_ALLOW_MISSING does not name it" in out
    assert "real part netlike skipped but" in out and "cannot build namespaces here" in out

    status, out = run_suite(tmp_path, REAL_PARTS, FSM_PD_REQUIRE_REAL_PARTS="1", FSM_PD_ALLOW_MISSING="gone")
    assert status == 1 and "real part netlike skipped but" in out and "real part gone skipped but" not in out, out

    status, out = run_suite(tmp_path, REAL_PARTS, FSM_PD_REQUIRE_REAL_PARTS="1", FSM_PD_ALLOW_MISSING="gone, netlike")
    assert status == 0, out
    assert "real parts: gone skipped 1 (allowed), here ran 1, netlike skipped 1 (allowed)\n" in out


def test_on_xdist_workers_real_parts_are_counted_and_a_skip_still_fails_the_session(tmp_path):
    """With -n 2 (the README's command) the tests run on workers and the session that counts sees only their
    reports: the counts and the failure must be the same as in one process."""
    status, out = run_suite(tmp_path, REAL_PARTS, "-n", "2")
    assert status == 0, out
    assert "1 passed, 3 skipped" in out and "bringing up nodes" in out  # xdist started its workers
    assert "real parts: gone skipped 1, here ran 1, netlike skipped 1\n" in out

    status, out = run_suite(tmp_path, REAL_PARTS, "-n", "2", FSM_PD_REQUIRE_REAL_PARTS="1")
    assert status == 1, out
    assert "real parts: gone skipped 1, here ran 1, netlike skipped 1\n" in out
    assert "real part gone skipped but FSM_PD_REQUIRE_REAL_PARTS=1 and FSM_PD_ALLOW_MISSING does not name it" in out
    assert "real part netlike skipped but" in out and "cannot build namespaces here" in out

    status, out = run_suite(tmp_path, REAL_PARTS, "-n", "2", FSM_PD_REQUIRE_REAL_PARTS="1",
                            FSM_PD_ALLOW_MISSING="gone, netlike")
    assert status == 0, out
    assert "real parts: gone skipped 1 (allowed), here ran 1, netlike skipped 1 (allowed)\n" in out


def test_on_xdist_workers_each_module_runs_on_one_worker(tmp_path):
    """tests/conftest.py groups every test by its module, so under -n 2 a module-scoped fixture is built once and a
    module's tests run on one worker (xdist's plain load scheduling would split them)."""
    record = tmp_path / "record.txt"
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_second.py").write_text(MODULE_FIXTURE)
    status, out = run_suite(tmp_path, MODULE_FIXTURE, "-n", "2", RECORD=str(record))
    assert status == 0 and "16 passed" in out, out
    lines = [line.split() for line in record.read_text().splitlines()]
    builds = [(module, worker) for what, module, worker in lines if what == "built"]
    assert sorted(module for module, _ in builds) == ["test_second", "test_throwaway"], lines
    for module, worker in builds:
        assert {w for what, m, w in lines if what == "ran" and m == module} == {worker}, lines


MODULE_FIXTURE = '''
import os
import pytest

def record(what, module):
    with open(os.environ["RECORD"], "a") as f:
        f.write(f"{what} {module} {os.environ['PYTEST_XDIST_WORKER']}\\n")

@pytest.fixture(scope="module")
def built_once(request):
    record("built", request.module.__name__)

@pytest.mark.parametrize("n", range(8))
def test_uses_the_module_fixture(built_once, request, n):
    record("ran", request.module.__name__)
'''


def test_on_xdist_workers_the_modules_with_a_slow_test_go_first(tmp_path):
    """tests/conftest.py hands out the modules with a ``slow`` test first (xdist's own order, biggest module first or
    as collected, would start this one last), so the run does not end on a long test while the other worker idles."""
    record = tmp_path / "record.txt"
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_b.py").write_text(MODULE_FIXTURE)
    (tmp_path / "tests" / "test_z.py").write_text(SLOW_MODULE)
    status, out = run_suite(tmp_path, MODULE_FIXTURE, "-n", "2", RECORD=str(record))
    assert status == 0 and "18 passed" in out, out
    lines = [line.split() for line in record.read_text().splitlines() if line.startswith("ran")]
    (worker,) = {w for _, module, w in lines if module == "test_z"}
    first = next(module for _, module, w in lines if w == worker)
    assert first == "test_z", lines


SLOW_MODULE = '''
import os
import pytest

def record(what, module):
    with open(os.environ["RECORD"], "a") as f:
        f.write(f"{what} {module} {os.environ['PYTEST_XDIST_WORKER']}\\n")

@pytest.mark.slow
def test_long(request):
    record("ran", request.module.__name__)

def test_short(request):
    record("ran", request.module.__name__)
'''


def test_httpx_clients_of_a_test_process_share_one_ssl_context_unless_they_ask_for_their_own():
    from httpx._transports import default
    from httpx_ssl import share_one_ssl_context

    assert share_one_ssl_context()  # conftest did it already: a second call changes nothing and says so
    assert default.create_ssl_context() is default.create_ssl_context()
    own = default.create_ssl_context(verify=False)
    assert own is not default.create_ssl_context() and own.verify_mode == ssl.CERT_NONE
    assert default.create_ssl_context().verify_mode == ssl.CERT_REQUIRED  # the default still verifies


def test_processes_tests_start_read_the_bytecode_written_once_even_where_none_is_written(tmp_path):
    """bytecode.compile_package: a package's modules compiled once, then read (not compiled) by a fresh interpreter
    that writes no bytecode (PYTHONDONTWRITEBYTECODE, as these machines set); an edited module is compiled from its
    source again; and the tests' own run wrote fsm-pd's (conftest.py)."""
    from bytecode import compile_package

    import fsm_pd

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("VALUE = 1\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tmp_path)}

    def loads() -> str:  # python -v names where each module's code object came from
        done = subprocess.run([sys.executable, "-v", "-c", "import pkg.mod; print(pkg.mod.VALUE)"], env=env,
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        found = [line for line in done.stderr.splitlines() if "pkg" in line and "code object from" in line]
        return done.stdout.strip() + " " + " ".join("pyc" if ".pyc" in line else "source" for line in found)

    assert loads() == "1 source source" and not (package / "__pycache__").exists()  # nothing written, each time
    assert compile_package(package)
    assert loads() == "1 pyc pyc"
    (package / "mod.py").write_text("VALUE = 22\n")  # another size: the bytecode no longer matches its source
    assert loads() == "22 pyc source"
    ours = Path(fsm_pd.__file__).parent
    if os.access(ours, os.W_OK):  # a read-only checkout is left as it is (bytecode.py)
        assert any((ours / "__pycache__").glob("__init__.*.pyc")), "the run did not write fsm-pd's bytecode"
