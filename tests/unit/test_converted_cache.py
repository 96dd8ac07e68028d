"""The converted-model cache (``model/converted.py``) reads back exactly the parameters it saved.

A TPU hands some arrays to NumPy column-major; safetensors writes memory as it lies, so such an entry read back
transposed values and every warm start on the chip answered noise. Here a column-major array stands for the chip's.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from fsm_pd.model import converted
from fsm_pd.model.params import random_params
from fsm_pd.model.tiny import tiny_model_parts
from fsm_pd.model.tokenizer import HFTokenizer

# device programs: on a TPU host they run in the process that holds the chip (tests/on_tpu.sh)
pytestmark = pytest.mark.chip


def word_tokenizer() -> HFTokenizer:
    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return HFTokenizer(raw, eos_token_ids=(2,), chat_template="{{ messages }}")


def test_an_entry_reads_back_every_tensor_also_when_the_device_handed_it_over_column_major(tmp_path):
    config, _, _ = tiny_model_parts("float32")
    params = random_params(config, seed=3)
    params["embed"] = np.asfortranarray(np.asarray(params["embed"]))  # as np.asarray of a TPU array can be
    params["layers"][0]["w_down"] = np.asfortranarray(np.asarray(params["layers"][0]["w_down"]))
    entry = tmp_path / "entry"
    converted.save(entry, config, params, word_tokenizer())
    loaded = converted.load(entry)
    assert loaded is not None
    config2, params2, tokenizer2 = loaded
    assert config2 == config
    assert np.array_equal(np.asarray(params2["embed"]), np.asarray(params["embed"]))
    for layer, layer2 in zip(params["layers"], params2["layers"], strict=True):
        for name, value in layer.items():
            assert np.array_equal(np.asarray(layer2[name]), np.asarray(value)), name
    assert tokenizer2.encode("hello world") == [1, 2] and tokenizer2.eos_token_ids == (2,)


def test_an_entry_of_another_format_is_not_read(tmp_path, monkeypatch):
    config, _, _ = tiny_model_parts("bfloat16")
    source = tmp_path / "model.gguf"
    source.write_bytes(b"x")
    old = converted.entry_dir(tmp_path, source, "bfloat16")
    monkeypatch.setattr(converted, "FORMAT", converted.FORMAT + 1)
    assert converted.entry_dir(tmp_path, source, "bfloat16") != old
    params = {k: v for k, v in random_params(config, seed=1).items()}
    converted.save(old, config, params, word_tokenizer())
    assert converted.load(old) is not None and jnp.asarray(converted.load(old)[1]["embed"]).dtype == jnp.bfloat16
