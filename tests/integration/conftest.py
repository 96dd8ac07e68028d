"""Fixtures shared by the integration tests."""

from __future__ import annotations

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
    shared = _SharedPD(tmp_path_factory)
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


@pytest.fixture(scope="session")
def smollm2_reference(tmp_path_factory):
    """A colocated SmolLM2 node with its prefix cache off, and its greedy chat answers to
    ``test_smollm2_serving.QUESTIONS`` (``chat``'s ``(text, tokens)``): the reference both SmolLM2 serving modules
    compare with (``test_smollm2_serving.py``, ``test_tp_smollm2.py``, one xdist group), started and asked once a
    test process. Greedy answers depend on nothing the node served before, and without its cache every later
    question is prefilled whole."""
    from processes import Cluster
    from test_smollm2_serving import MODEL, QUESTIONS, chat

    cluster = Cluster(tmp_path_factory.mktemp("smollm2-reference"))
    try:
        url = cluster.serve("colocated", "--disable-radix-cache", *MODEL)
        yield url, [chat(url, q) for q in QUESTIONS]
    finally:
        cluster.stop()


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


@pytest.fixture(scope="session")
def _rigs():
    made: dict = {}
    yield made
    for r in made.values():
        r.stop()


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
