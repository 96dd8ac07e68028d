"""Fixtures shared by the integration tests.

The processes a session-scoped fixture holds for a group of tests (``pd_urls``' cluster, the fault rigs of
``shared_rig``, ``smollm2_reference``'s node) are stopped as soon as the next test this process runs does not use
them (``pytest_runtest_teardown`` below), not at the session's end: idle, a node still takes 1 to 2 % of a core
(its heartbeats and loops), and the fault rigs and the shared cluster, 10 processes, sat idle for most of a run on
the worker that had used them. Each is started again should a later test ask for it.
"""

from __future__ import annotations

import itertools

import pytest

from fsm_pd.model.loader import load_model


@pytest.fixture(scope="module")
def model():
    """The built-in tiny model, loaded once per module."""
    return load_model("tiny")


class _SharedPD:
    """The test process's one PD cluster (``processes.pd_beside_colocated``), started by the first module that asks
    for it and handed to the next ones while it is whole; stopped at the session's end."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory, self.cluster, self.urls = tmp_path_factory, None, None

    def get(self) -> dict[str, str]:
        if self.cluster is not None and not self._whole():
            self.stop()  # a module broke it (a process gone, or not answering): the next one gets a new cluster
        if self.cluster is None:
            from processes import Cluster, pd_beside_colocated

            self.cluster = Cluster(self.tmp_path_factory.mktemp("shared-pd"))
            try:
                self.urls = pd_beside_colocated(self.cluster)
            except BaseException:
                self.stop()
                raise
        return self.urls

    def _whole(self) -> bool:
        import httpx

        try:
            return all(proc.poll() is None for proc in self.cluster.procs) and all(
                httpx.get(url + "/health", timeout=10).status_code == 200 for url in self.urls.values())
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        self.cluster = self.urls = None


@pytest.fixture(scope="session")
def _shared_pd(tmp_path_factory):
    shared = _live["_shared_pd"] = _SharedPD(tmp_path_factory)
    yield shared
    shared.stop()


@pytest.fixture(scope="module")
def pd_urls(_shared_pd):
    """A PD pair behind the built-in router (and the real sglang-router when installed) beside a colocated node,
    ``processes.pd_beside_colocated``'s ``{"colocated", "router", "prefill", "decode", "sglang-router"?}``: one
    cluster for every module of this test process that asks for it (3 to 5 node starts and their first compiles less
    for each module after the first). Only for tests that need no fresh one: they send requests and compare answers,
    and change nothing a later module would see (no drain, no node stopped, no counter read as an absolute, nothing
    left running). A module that leaves it broken costs the next one a new cluster, not its tests."""
    return dict(_shared_pd.get())


class _SmolLM2Reference:
    """``smollm2_reference``'s node and answers, started and asked on first use (again after ``stop``)."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory, self.cluster, self.answers = tmp_path_factory, None, None

    def get(self) -> tuple[str, list]:
        if self.answers is None:
            from processes import Cluster
            from test_smollm2_serving import MODEL, QUESTIONS, chat

            self.cluster = Cluster(self.tmp_path_factory.mktemp("smollm2-reference"))
            try:
                url = self.cluster.serve("colocated", "--disable-radix-cache", *MODEL)
                self.answers = url, [chat(url, q) for q in QUESTIONS]
            except BaseException:
                self.stop()
                raise
        return self.answers

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        self.cluster = self.answers = None


@pytest.fixture(scope="session")
def _smollm2_reference(tmp_path_factory):
    reference = _live["_smollm2_reference"] = _SmolLM2Reference(tmp_path_factory)
    yield reference
    reference.stop()


@pytest.fixture
def smollm2_reference(_smollm2_reference):
    """A colocated SmolLM2 node with its prefix cache off, and its greedy chat answers to
    ``test_smollm2_serving.QUESTIONS`` (``chat``'s ``(text, tokens)``): the reference both SmolLM2 serving modules
    compare with (``test_smollm2_serving.py``, ``test_tp_smollm2.py``, one xdist group), started and asked once a
    test process. Greedy answers depend on nothing the node served before, and without its cache every later
    question is prefilled whole."""
    return _smollm2_reference.get()


@pytest.fixture
def rig(tmp_path):
    """``rig(**kwargs)`` starts a fault rig (``fault_rig.Rig``: prefill, decode and router processes); every rig a
    test made is stopped at its end."""
    from fault_rig import Rig

    made = []

    def make(**kwargs) -> Rig:
        made.append(Rig(tmp_path, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.stop()


class _Rigs(dict):
    """``shared_rig``'s rigs by their arguments."""

    def stop(self) -> None:
        for r in self.values():
            r.stop()
        self.clear()


@pytest.fixture(scope="session")
def _rigs():
    made = _live["_rigs"] = _Rigs()
    yield made
    made.stop()


@pytest.fixture
def shared_rig(_rigs, tmp_path_factory):
    """``shared_rig(**kwargs)``: the test process's fault rig made with these arguments (``fault_rig.Rig``), started
    by the first test that asks for it and handed to the next ones, of its module or another (``test_faults.py`` and
    ``test_restarts.py``, one xdist group), while it is whole (``Rig.reusable``; else another is started), paused and
    without faults (``Rig.set_faults``). Each test warms it up first, which takes the baselines and the failed rooms
    so far that ``Rig.failures`` leaves out. Stopped at the session's end."""
    from fault_rig import Rig

    def get(**kwargs) -> Rig:
        key = repr(sorted(kwargs.items()))
        found = _rigs.get(key)
        if found is not None and not found.reusable():
            _rigs.pop(key).stop()
            found = None
        if found is None:
            found = _rigs[key] = Rig(tmp_path_factory.mktemp("rig"), **kwargs)
        found.faults_off()
        found.set_faults()
        return found

    return get


# The session fixtures above whose processes stop early: fixture name -> what holds them (a ``stop()``; a later
# ``get`` starts them again)
_live: dict[str, object] = {}
_places: dict[str, int] = {}  # each test's place in session.items


def _group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return None if mark is None else str(mark.args[0] if mark.args else mark.kwargs.get("name"))


def _used_later(name: str, item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    """Whether a test this process runs after ``item`` uses fixture ``name``. A run without xdist runs
    ``session.items`` in order: any test after it tells. An xdist worker runs whole groups (tests/conftest.py), each
    in ``session.items``' order, and the tests of one shared fixture are one group (``shared-pd``, ``fault-rig``,
    ``smollm2``): the rest of its group tells (``fault-rig`` has a test without the rig between its two modules)."""
    if nextitem is None:
        return False
    if name in nextitem.fixturenames:
        return True
    items = item.session.items
    if not _places:
        _places.update((test.nodeid, i) for i, test in enumerate(items))
    later = items[_places.get(item.nodeid, len(items)) + 1:]
    if hasattr(item.config, "workerinput"):
        group = _group(item)
        later = itertools.takewhile(lambda test: _group(test) == group, later)
    return any(name in test.fixturenames for test in later)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a test's own teardown: stop the shared processes no test after it in this process uses."""
    try:
        return (yield)
    finally:
        for name, held in _live.items():
            if name in item.fixturenames and not _used_later(name, item, nextitem):
                held.stop()
