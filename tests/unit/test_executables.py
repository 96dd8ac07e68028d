"""The executable store (``model/executables.py``): a warm start's forward programs are loaded whole, not traced,
lowered or compiled again, and compute what the compiled ones do, the pool still donated; anything that could make
another program (the model's source among it) is another entry; an entry that cannot be read is compiled anew."""

from __future__ import annotations

import logging
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from fsm_pd.model import compiles, decoder, executables
from fsm_pd.model.programs import ForwardPrograms, LayeredForward, OneProgram
from fsm_pd.model.tiny import tiny_model_parts

# device programs: on a TPU host they run in the process that holds the chip (tests/on_tpu.sh)
pytestmark = pytest.mark.chip


@pytest.fixture
def store(tmp_path):
    directory = executables.enable(tmp_path / "executables")
    yield directory
    executables.enable(None)


@pytest.fixture(scope="module")
def tiny():
    config, params, _ = tiny_model_parts()
    return config, params


def pool_of(config):
    return tuple(jnp.zeros((64, 16, 2 * config.num_kv_heads * config.head_dim), jnp.float32)
                 for _ in range(config.num_layers))


def prefill(config, params, programs):
    pool = pool_of(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would be raised here
        result = decoder.prefill(config, params, pool, list(range(1, 12)), [1], forward=programs)
    assert all(layer.is_deleted() for layer in pool)  # donated, as a compiled program's pool is
    return np.asarray(result.logits)


def loaded() -> int:
    """Programs this process loaded whole from the store so far (``compiles.loaded``: no compile counts there)."""
    return sum(cost.from_cache for cost in compiles.costs().values())


@pytest.mark.parametrize("layers_per_program, kind, programs", [(None, OneProgram, 1), (1, LayeredForward, 3)],
                         ids=["one-program", "layer-groups"])
def test_a_warm_start_loads_its_programs_whole(tiny, store, layers_per_program, kind, programs):
    config, params = tiny
    compiled = ForwardPrograms(config, params, pool_of(config), layers_per_program=layers_per_program)
    want = prefill(config, params, compiled)
    assert len(list(store.iterdir())) == 1  # the shape's programs, one entry

    before = loaded()
    warm = ForwardPrograms(config, params, pool_of(config), layers_per_program=layers_per_program)
    assert isinstance(warm.compile(1, 16), kind)
    assert loaded() == before + programs  # the embedding, one program per group size, the head; or the whole
    np.testing.assert_allclose(prefill(config, params, warm), want, rtol=1e-6, atol=1e-6)


def test_another_source_or_shape_is_another_entry(tiny, store, monkeypatch):
    config, params = tiny
    ForwardPrograms(config, params, pool_of(config)).compile(1, 16)
    ForwardPrograms(config, params, pool_of(config)).compile(2, 16)
    assert len(list(store.iterdir())) == 2
    before = loaded()
    monkeypatch.setattr(executables, "_digest", "a changed line of fsm_pd/model")
    ForwardPrograms(config, params, pool_of(config)).compile(1, 16)
    assert loaded() == before and len(list(store.iterdir())) == 3


def test_an_entry_that_cannot_be_read_is_compiled_anew(tiny, store, caplog):
    config, params = tiny
    ForwardPrograms(config, params, pool_of(config)).compile(1, 16)
    (entry,) = store.iterdir()
    entry.write_bytes(entry.read_bytes()[:100])  # torn
    before = loaded()
    with caplog.at_level(logging.WARNING, logger="fsm_pd.model.executables"):
        ForwardPrograms(config, params, pool_of(config)).compile(1, 16)
    assert loaded() == before and "cannot load" in caplog.text
    assert entry.stat().st_size > 100  # written again, whole


def test_off_nothing_is_kept(tiny, tmp_path):
    config, params = tiny
    assert not executables.enabled()
    ForwardPrograms(config, params, pool_of(config)).compile(1, 16)
    assert not (tmp_path / "executables").exists()
