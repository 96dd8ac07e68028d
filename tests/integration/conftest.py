"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from fsm_pd.model.loader import load_model


@pytest.fixture(scope="module")
def model():
    """The built-in tiny model, loaded once per module."""
    return load_model("tiny")


@pytest.fixture(scope="module")
def pd_urls(tmp_path_factory, request):
    """One per test module: a PD pair behind the built-in router (and the real sglang-router when installed) beside a
    colocated node, ``processes.pd_beside_colocated``'s ``{"colocated", "router", "decode", "sglang-router"?}``."""
    from processes import Cluster, pd_beside_colocated

    cluster = Cluster(tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2]))
    try:
        yield pd_beside_colocated(cluster)
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


@pytest.fixture(scope="module")
def _module_rigs():
    made: dict = {}
    yield made
    for r in made.values():
        r.stop()


@pytest.fixture
def shared_rig(_module_rigs, tmp_path_factory):
    """``shared_rig(**kwargs)``: the module's fault rig made with these arguments (``fault_rig.Rig``), started by the
    first test that asks for it and handed to the next ones while it is whole (``Rig.reusable``; else another is
    started), paused and without faults (``Rig.set_faults``). Each test warms it up first, which takes the baselines
    and the failed rooms so far that ``Rig.failures`` leaves out. Stopped at the module's end."""
    from fault_rig import Rig

    def get(**kwargs) -> Rig:
        key = repr(sorted(kwargs.items()))
        found = _module_rigs.get(key)
        if found is not None and not found.reusable():
            _module_rigs.pop(key).stop()
            found = None
        if found is None:
            found = _module_rigs[key] = Rig(tmp_path_factory.mktemp("rig"), **kwargs)
        found.faults_off()
        found.set_faults()
        return found

    return get
