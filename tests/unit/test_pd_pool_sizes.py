"""``--role pd`` on an accelerator sizes its pools from the device memory its weights will leave
(``serve_pd.pool_pages``), and does so while the weights still load (``model/meanwhile.py``): the same pages as once
they are on the device, without waiting for them."""

from __future__ import annotations

import argparse
import gc
import threading

import jax
import pytest
from test_gguf_loader import gguf_tensors, small_config, write_gguf

from fsm_pd.cli.serve_pd import pool_pages
from fsm_pd.model import converted
from fsm_pd.model.loader import load_model
from fsm_pd.model.meanwhile import ModelMeanwhile
from fsm_pd.model.params import random_params

pytestmark = pytest.mark.chip  # device arrays: on a TPU host in the process that holds the chip (tests/on_tpu.sh)


class Accelerator:
    """A device as ``pool_pages`` reads one: an accelerator's platform, its memory in use that of every live array."""

    platform = "tpu"

    def memory_stats(self) -> dict:
        return {"bytes_limit": 1 << 30, "bytes_in_use": sum(a.nbytes for a in jax.live_arrays())}


def test_pools_sized_while_the_weights_load_get_the_pages_they_get_once_the_weights_are_in(tmp_path, monkeypatch):
    config = small_config()
    path = write_gguf(tmp_path / "m.gguf", config, gguf_tensors(config, random_params(config, seed=9)))
    monkeypatch.setenv(converted.ENV, str(tmp_path / "cache"))
    load_model(str(path))  # converted into the cache; its arrays go with it
    gc.collect()
    release = threading.Event()
    read = converted.load_host_params
    monkeypatch.setattr(converted, "load_host_params", lambda entry, config: release.wait(60) and read(entry, config))
    reading = ModelMeanwhile(str(path), "float32")
    model = reading.model(timeout=60)
    model.device = Accelerator()
    # the stand-in device has no compiler to say how it pads a page: a page takes its values' bytes
    monkeypatch.setattr(type(model), "page_bytes_on_device",
                        lambda self, page_size: self.make_kv_layout(2, page_size).page_bytes())
    models = {"prefill": model, "decode": model}
    args = argparse.Namespace(prefill_pages=None, decode_pages=None, page_size=16, kv_memory_fraction=0.8,
                              prefill_pool_share=0.3)
    try:
        before = pool_pages(args, models, reading)
        assert model.pending is not None and not model.pending.done()  # sized without waiting for the weights
    finally:
        release.set()
    model.wait_for_weights(timeout=60)
    assert pool_pages(args, models, reading) == before
    assert pool_pages(args, models) == before  # as measured with the weights on the device
