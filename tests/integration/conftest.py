"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from fsm_pd.engine.loader import load_model


@pytest.fixture(scope="module")
def model():
    """The built-in tiny model, loaded once per module."""
    return load_model("tiny")


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
