"""Suite-wide test settings. Every test has a timeout (pytest-timeout, 300 s by default in pyproject.toml; a longer
test sets its own with ``@pytest.mark.timeout(S)``). Tests of real parts (PostgreSQL, netns, ...) say so with
``@pytest.mark.real_part``, and a skip of one is counted and, where CI requires them, fails the run
(``real_parts.py``).

The README's test command runs the suite on two pytest-xdist workers (``-n 2``; ``--dist loadgroup`` is in
pyproject.toml's addopts, and without ``-n`` everything runs in this one process, as when running one test). Each
worker takes whole test modules (``pytest_collection_modifyitems`` below puts every test in its module's xdist group),
so a module-scoped fixture (a cluster of nodes, a compiled model) is built once, and a module's tests run in their
order, as they do serially. A test with its own ``@pytest.mark.xdist_group(name)`` keeps that group instead. The
groups that hold a ``slow`` test go first, so the run does not end on one long test while the other worker idles.

On a TPU host (``tests/on_tpu.sh``) the tests marked ``chip`` (device programs: kernels, model steps, handoffs on
the device) run in one process, which takes the chip before any test runs and whose children run jax on the CPU;
the others run at the same time on pytest-xdist workers with ``JAX_PLATFORMS=cpu``. The fixtures ``cpu_default`` and
``full_precision`` are for tests of what only a CPU does and for tests that compare float32 results
(``on_chip.py``). On a CPU machine they change nothing. ``FSM_PD_SUITE_LOG`` names a file that records the run as it
goes (``suite_log.py``), ``FSM_PD_SUITE_COMPILES=1`` adds each test's compiles to it (``suite_compiles.py``),
``FSM_PD_SUITE_COMPILE_CACHE`` a persistent compile cache for the run. On a CPU, XLA
compiles with its cheapest settings in the processes that run tests, and with cheaper ones that cost nothing at run time
in the processes tests start (``xla_flags.py``). The httpx clients of a process that runs tests share one SSL context
(``httpx_ssl.py``). fsm-pd's bytecode is written once, before any test, so that the processes tests start read it
even where ``PYTHONDONTWRITEBYTECODE`` is set, and the test modules' while they are collected, for the next run
(``bytecode.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Helpers every test tree shares (the model-free stub engine, the in-process "fake" transfer backend) live beside this
# file, outside the package.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bytecode  # noqa: E402 - after the path above
import on_chip  # noqa: E402
import suite_compiles  # noqa: E402
import suite_log  # noqa: E402
import xla_flags  # noqa: E402
from httpx_ssl import share_one_ssl_context  # noqa: E402
from node_sockets import allow_the_fake_backend  # noqa: E402
from real_parts import RealParts  # noqa: E402

import fsm_pd  # noqa: E402
from fsm_pd.runtime import compile_cache  # noqa: E402
from fsm_pd.transport.backends import register_backend  # noqa: E402

_CHIP = pytest.StashKey[str | None]()  # where this process runs jax, on a host with a TPU runtime
# JAX's persistent compile cache for the run, where set (tests/on_tpu.sh): a program compiled once, by the chip's
# process, a CPU worker or a node a test started, is read back by the others instead of compiled again
SUITE_COMPILE_CACHE = "FSM_PD_SUITE_COMPILE_CACHE"

register_backend("fake", "fake_backend:FakeTransferBackend", replace=True)
allow_the_fake_backend()  # where this host has no TCP, engines on unix sockets use it too (node_sockets.py)
share_one_ssl_context()  # not one per httpx.get() a test sends: 26 ms of CPU each, thousands a run (httpx_ssl.py)

# Every node a test starts (fsm-pd serve / launch without --model) serves the built-in tiny model, not SmolLM2.
os.environ["FSM_PD_MODEL"] = "tiny"
# ... and starts serving without its warm-up (seconds per node start; a test sends a few shapes). The warm-up's own
# tests turn it back on (tests/unit/test_warmup.py, tests/integration/test_warmup_serving.py).
os.environ["FSM_PD_SKIP_SERVER_WARMUP"] = "1"
# ... and its engines decode a step a dispatch unless a test asks for more (the default on an accelerator is 8,
# serving/device_steps.py): on the chip each 8-step loop program is ~15 s of compiling, which every engine a chip test
# builds would start in the background. The several-steps path has its own tests, which ask for K (test_decode_steps,
# test_pd_shared_dispatch, test_warmup), and the chip check runs it at the default (chip_parity, the load bench).
os.environ.setdefault("FSM_PD_DECODE_STEPS_PER_DISPATCH", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "real_part(name, missing=None): the test runs this real part (a PostgreSQL "
                                       "server, netns, ...); see tests/real_parts.py")
    config.addinivalue_line("markers", "slow: a long run (about 10 s or more on 2 cores: the real model, restarts, "
                                       "drills); `-m 'not slow'` leaves them out of a quick loop, CI runs them all")
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist runs the tests of one group on one worker, "
                                       "one after the other (also registered here for runs with -p no:xdist)")
    config.addinivalue_line("markers", "chip: the test runs device programs (kernels, model steps, on-device "
                                       "handoffs): on a TPU host it runs in the one process that holds the chip, the "
                                       "rest on CPU workers at the same time (tests/on_tpu.sh)")
    config.pluginmanager.register(RealParts(os.environ), "fsm-pd-real-parts")
    # The record is this run's alone: taken out of the environment, so that a pytest a test starts (the suite's own
    # tests run throwaway suites) does not write its tests into it. Under xdist the controller writes it, from the
    # workers' reports, and the workers it starts next never see it.
    if not hasattr(config, "workerinput"):  # before xdist starts its workers: every process after it reads it
        bytecode.compile_package(Path(fsm_pd.__file__).parent)
    log = os.environ.pop(suite_log.ENV, None)
    if log and not hasattr(config, "workerinput"):
        config.pluginmanager.register(suite_log.SuiteLog(log, Path(log).stem), "fsm-pd-suite-log")
    cache = os.environ.get(SUITE_COMPILE_CACHE)
    runs_tests = hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)
    # XLA's cheapest compiles for this process if it runs tests, cheaper ones for the processes they start
    # (xla_flags.py): most of the suite's time is XLA compiling the tiny model's programs
    xla_flags.use_fast_compile(chip_possible=on_chip.tpu_runtime_installed(), runs_tests=runs_tests,
                               shared_cache=bool(cache))
    if cache:  # this process's programs, and those of the nodes tests start (FSM_PD_COMPILE_CACHE), share one cache
        compile_cache.enable(cache)
        os.environ[compile_cache.ENV] = cache
    if runs_tests:
        config.stash[_CHIP] = on_chip.take_the_chip()
        if os.environ.get(suite_compiles.ENV):  # after the chip is taken: the counter starts jax
            counter = suite_compiles.CompileCounter(names=os.environ[suite_compiles.ENV] == "names")
            config.pluginmanager.register(counter, "fsm-pd-suite-compiles")


def pytest_terminal_summary(terminalreporter, config):
    where = config.stash.get(_CHIP, None)
    if where:
        terminalreporter.write_line(where)


@pytest.fixture
def cpu_default():
    """The CPU is jax's default device for this test: a test of what only a CPU does (``on_chip.py``)."""
    with on_chip.cpu_default():
        yield


@pytest.fixture(scope="module")
def full_precision():
    """float32 products at full precision for this module's tests and the programs its fixtures compile: for a module
    that compares float32 results with a reference or across paths (``on_chip.py``). Use it as ``pytestmark =
    pytest.mark.usefixtures("full_precision")``, which puts it before the module's own fixtures."""
    with on_chip.full_precision():
        yield


@pytest.fixture(autouse=True)
def _demands_stay_with_their_test():
    """What a serving process keeps process-wide stays with the test that made it: the sampler batch buckets marked
    prepared (``sampling._prepared``: a later test's batch was padded up to another test's buckets) and the programs
    requests ran without (``compile_demand``: a later test's background compile compiled them, for engines long gone:
    20 sampler programs, of vocabularies of four other tests, in one test_warmup test of the chip half)."""
    sampling = sys.modules.get("fsm_pd.model.sampling")
    prepared = set(sampling._prepared) if sampling is not None else None
    yield
    sampling = sys.modules.get("fsm_pd.model.sampling")
    if sampling is not None:
        sampling._prepared.clear()
        sampling._prepared.update(prepared or ())
    demand = sys.modules.get("fsm_pd.model.compile_demand")
    if demand is not None:
        with demand._lock:
            for queue in demand._queues:
                queue.clear()
            demand._noted.clear()
            demand._wanted.clear()


def _group(item: pytest.Item) -> str:
    """The test's xdist group: the one it names, else its module."""
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return item.nodeid.split("::")[0]
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """The test modules' bytecode, as pytest's assertion rewriting made it, is written where PYTHONDONTWRITEBYTECODE
    is set too, for the next run's collection to read (``bytecode.py``)."""
    with bytecode.written_while():
        return (yield)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the tests' ids
def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # not an xdist worker: nothing is distributed, the groups would not matter
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
    # xdist hands groups to idle workers in this order (--no-loadscope-reorder in addopts): the groups with a slow
    # test first, bigger ones before smaller, so that no long test starts last while the other worker has nothing left
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(_group(item), []).append(item)
    slow = {name for name, members in groups.items() if any(i.get_closest_marker("slow") for i in members)}
    order = sorted(groups, key=lambda name: (name not in slow, -len(groups[name]) if name in slow else 0))
    items[:] = [item for name in order for item in groups[name]]
