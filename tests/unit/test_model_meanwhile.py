"""A model read on a thread of its own (``model/meanwhile.py``): a node builds its engine and compiles its ready set
from the weights' shapes while the weights still load, and once they are in it answers as a model loaded whole."""

from __future__ import annotations

import asyncio
import threading

import jax
import pytest
from test_gguf_loader import gguf_tensors, small_config, write_gguf

from fsm_pd.model import compiles, converted
from fsm_pd.model.loader import load_model
from fsm_pd.model.meanwhile import ModelMeanwhile, applies
from fsm_pd.model.params import random_params
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.types import GenerateRequest
from fsm_pd.serving.warmup import warm_up

# device programs and answers compared: on a TPU host in the process that holds the chip (tests/on_tpu.sh)
pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]

PAGES = 37  # a pool size no other test uses: its programs (shared per process and pool shape) start empty


def _answers(engine) -> list[list[int]]:
    requests = [GenerateRequest(f"m{i}", [(5 * i + j) % 20 + 3 for j in range(n)],
                                SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True), seed=i)
                for i, n in enumerate((3, 11, 30))]

    async def serve_all():
        return [await generate(engine, r) for r in requests]

    return [[t.token_id for t in out] for out in asyncio.run(asyncio.wait_for(serve_all(), 240))]


def test_a_node_compiles_its_ready_set_while_the_weights_load_and_then_answers_as_a_whole_model(tmp_path, monkeypatch):
    config = small_config()
    path = write_gguf(tmp_path / "m.gguf", config, gguf_tensors(config, random_params(config, seed=3, std=0.5)))
    monkeypatch.setenv(converted.ENV, str(tmp_path / "cache"))
    assert applies(str(path)) and not applies(str(path), tp=2) and not applies("tiny")
    whole = load_model(str(path))  # converts the file into the cache: the thread below reads the entry
    release, held = threading.Event(), threading.Event()
    read = converted.load_host_params

    def held_back(entry, config):  # the weights stay on the disk until the ready set is compiled
        held.set()
        assert release.wait(120)
        return read(entry, config)

    monkeypatch.setattr(converted, "load_host_params", held_back)
    reading = ModelMeanwhile(str(path), "float32")
    model = reading.model(timeout=60)
    assert model.config == whole.config and isinstance(model.params["embed"], jax.ShapeDtypeStruct)
    engine = ColocatedEngine(model, num_pages=PAGES, page_size=16, chunked_prefill_size=64)
    reference = None
    try:
        assert held.wait(60)
        warm_up(engine, progress=False)
        assert model.pending is not None and not release.is_set()  # compiled from shapes: no weight was read
        # the programs it compiled are the ones a model loaded whole runs: the shapes' signature is the weights'
        pool = engine.model_thread.pool
        assert model.programs(pool) is whole.programs(pool)
        release.set()
        model.wait_for_weights(timeout=120)
        assert model.pending is None and reading.seconds["weights"] >= reading.seconds["model"]
        before = sum(compiles.counts().values())
        answers = _answers(engine)
        assert sum(compiles.counts().values()) == before, f"compiled while serving: {list(compiles.late)}"
        reference = ColocatedEngine(whole, num_pages=PAGES, page_size=16, chunked_prefill_size=64)
        assert _answers(reference) == answers
    finally:
        release.set()
        engine.close()
        if reference is not None:
            reference.close()


def test_weights_that_cannot_be_read_fail_the_wait_not_the_config(tmp_path, monkeypatch):
    config = small_config()
    path = write_gguf(tmp_path / "m.gguf", config, gguf_tensors(config, random_params(config, seed=4)),
                      skip=("blk.1.ffn_down.weight",))
    monkeypatch.setenv(converted.ENV, str(tmp_path / "cache"))
    reading = ModelMeanwhile(str(path), "float32")
    model = reading.model(timeout=60)  # the metadata reads: the config and tokenizer are there
    assert model.config.num_layers == 2
    with pytest.raises(ValueError, match="blk.1.ffn_down.weight"):
        model.wait_for_weights(timeout=60)
