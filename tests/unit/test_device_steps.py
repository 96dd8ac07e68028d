"""How many decode steps a dispatch runs when nobody says: by where the pool is, after the flag and the environment."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fsm_pd.serving import device_steps


def pool_on(platform: str) -> list:
    """A pool's first layer as ``steps_per_dispatch`` reads it: an array whose sharding names its devices."""
    device = SimpleNamespace(platform=platform)
    return [SimpleNamespace(sharding=SimpleNamespace(device_set=[device]))]


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(device_steps.STEPS_ENV, raising=False)  # the suite sets it (tests/conftest.py)


def test_an_accelerator_runs_eight_steps_a_dispatch_and_a_cpu_one(no_env):
    # measured on a TPU v5e: 1.17 / 3.29 / 1.90x the output tok/s of one step at a time (device_steps.py)
    assert device_steps.steps_per_dispatch(None, pool_on("tpu")) == 8
    assert device_steps.steps_per_dispatch(None, pool_on("gpu")) == 8
    assert device_steps.steps_per_dispatch(None, pool_on("cpu")) == 1


def test_the_flag_wins_over_the_environment_which_wins_over_the_platform(monkeypatch):
    monkeypatch.setenv(device_steps.STEPS_ENV, "4")
    assert device_steps.steps_per_dispatch(None, pool_on("tpu")) == 4
    assert device_steps.steps_per_dispatch(None, pool_on("cpu")) == 4
    assert device_steps.steps_per_dispatch(2, pool_on("tpu")) == 2


def test_fewer_than_one_step_is_refused(no_env):
    with pytest.raises(ValueError, match="at least 1"):
        device_steps.steps_per_dispatch(0, pool_on("tpu"))
