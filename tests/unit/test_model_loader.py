"""load_model: the built-in tiny model, checkpoint directories, and the errors a wrong spec gets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fsm_pd.kernels.layout import KVLayout
from fsm_pd.model.config import UnsupportedModelError
from fsm_pd.model.loader import load_model
from fsm_pd.model.tokenizer import render_chat
from fsm_pd.model.weights import CheckpointError, save_hf_checkpoint


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def test_tiny_is_deterministic_and_small(tiny):
    again = load_model("tiny")
    np.testing.assert_array_equal(np.asarray(tiny.params["embed"]), np.asarray(again.params["embed"]))
    assert tiny.config.num_layers == 2 and tiny.config.vocab_size >= 260


def test_tiny_tokenizer_round_trips_text_and_specials(tiny):
    tok = tiny.tokenizer
    text = "héllo <|im_end|> wörld"
    ids = tok.encode(text)
    assert tok.special_ids["<|im_end|>"] in ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "héllo  wörld"
    assert tok.special_ids["<|endoftext|>"] in tiny.eos_token_ids


def test_tiny_chat_template_renders_chatml(tiny):
    text = render_chat(tiny.tokenizer.chat_template, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_kv_layout_and_pool_follow_the_config(tiny):
    layout = tiny.make_kv_layout(num_pages=10, page_size=8)
    assert (layout.num_layers, layout.kv_heads, layout.head_dim) == (2, 2, 16)
    pool = tiny.make_pool(layout)
    assert len(pool) == 2 and pool[0].shape == (10, 8, 64)
    wrong = KVLayout(num_layers=3, num_pages=10, page_size=8, kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="does not fit"):
        tiny.make_pool(wrong)


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither 'tiny' nor an existing directory"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def _write_tiny_checkpoint(directory, tiny, hf_config=None):
    save_hf_checkpoint(directory, tiny.config, tiny.params)
    (directory / "config.json").write_text(json.dumps(hf_config or tiny.config.to_hf()))


def test_unsupported_architecture_is_named(tmp_path, tiny):
    hf = tiny.config.to_hf() | {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    _write_tiny_checkpoint(tmp_path, tiny, hf)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path))


def test_checkpoint_without_tokenizer_json_is_a_clear_error(tmp_path, tiny):
    _write_tiny_checkpoint(tmp_path, tiny)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(str(tmp_path))


def test_checkpoint_missing_tensors_names_them(tmp_path, tiny):
    from tokenizers import Tokenizer, models

    _write_tiny_checkpoint(tmp_path, tiny)
    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    hf = tiny.config.to_hf() | {"num_hidden_layers": 3}  # the checkpoint only has layers 0 and 1
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="model.layers.2.input_layernorm.weight"):
        load_model(str(tmp_path))
