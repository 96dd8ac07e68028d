"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from fsm_pd.engine.loader import load_model


@pytest.fixture(scope="module")
def model():
    """The built-in tiny model, loaded once per module."""
    return load_model("tiny")
