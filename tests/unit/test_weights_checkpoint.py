"""Reading HF checkpoints: config parsing, single and sharded safetensors, dtypes, tokenizer side files."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from fsm_pd.model.config import ModelConfig, UnsupportedModelError
from fsm_pd.model.params import cast_params, random_params
from fsm_pd.model.tiny import tiny_config
from fsm_pd.model.tokenizer import load_hf_tokenizer
from fsm_pd.model.weights import INDEX_FILE, CheckpointError, load_params, save_hf_checkpoint

HF_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "eos_token_id": 2,
}  # fmt: skip


def test_config_reads_transformers_v5_rope_parameters():
    cfg = ModelConfig.from_hf(HF_LLAMA | {"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling is None
    assert cfg.head_dim == 8 and cfg.group_size == 2 and cfg.eos_token_ids == (2,)


def test_config_reads_legacy_rope_theta_and_llama3_scaling():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = ModelConfig.from_hf(HF_LLAMA | {"rope_theta": 1e4, "rope_scaling": scaling})
    assert cfg.rope_theta == 1e4
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 8.0


def test_config_family_switches():
    qwen2 = ModelConfig.from_hf(HF_LLAMA | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    qwen3 = ModelConfig.from_hf(HF_LLAMA | {"architectures": ["Qwen3ForCausalLM"], "head_dim": 16})
    assert qwen2.attention_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 16


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["MixtralForCausalLM"]}, "unsupported architecture"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"hidden_act": "gelu"}, "gelu"),
    ],
)
def test_config_rejects_what_the_decoder_lacks(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(HF_LLAMA | change)


def _assert_same_params(a, b):
    for name in ("embed", "final_norm"):
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    for la, lb in zip(a["layers"], b["layers"], strict=True):
        assert la.keys() == lb.keys()
        for name in la:
            np.testing.assert_array_equal(np.asarray(la[name]), np.asarray(lb[name]))


@pytest.mark.parametrize("shard", [None, 5])
def test_save_then_load_round_trips(tmp_path, shard):
    config = tiny_config()
    params = random_params(config, seed=7)
    save_hf_checkpoint(tmp_path, config, params, max_shard_tensors=shard)
    assert (tmp_path / INDEX_FILE).is_file() == (shard is not None)
    if shard:
        assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    _assert_same_params(load_params(tmp_path, config), params)


def test_linear_weights_are_transposed_from_hf_layout(tmp_path):
    from safetensors.numpy import load_file

    config = tiny_config()
    params = random_params(config, seed=1)
    save_hf_checkpoint(tmp_path, config, params)
    raw = load_file(str(tmp_path / "model.safetensors"))
    q_proj = raw["model.layers.0.self_attn.q_proj.weight"]  # HF: [out, in]
    assert q_proj.shape == (config.num_heads * config.head_dim, config.hidden_size)
    layer = {name: np.asarray(value) for name, value in params["layers"][0].items()}
    np.testing.assert_array_equal(q_proj.T, layer["wqkv"][:, : q_proj.shape[0]])  # fused [q | k | v]
    v_proj = raw["model.layers.0.self_attn.v_proj.weight"]
    np.testing.assert_array_equal(v_proj.T, layer["wqkv"][:, -v_proj.shape[0] :])
    up_proj = raw["model.layers.0.mlp.up_proj.weight"]  # fused [gate | up]
    np.testing.assert_array_equal(up_proj.T, layer["w_gate_up"][:, config.intermediate_size :])


def test_bfloat16_checkpoint_loads_as_float32(tmp_path):
    config = tiny_config()
    params = random_params(config, seed=2)
    save_hf_checkpoint(tmp_path, config, cast_params(params, "bfloat16"))
    loaded = load_params(tmp_path, config)
    assert loaded["embed"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(loaded["embed"]), np.asarray(params["embed"]), rtol=1e-2)


def test_index_naming_a_missing_shard_is_an_error(tmp_path):
    config = tiny_config()
    save_hf_checkpoint(tmp_path, config, random_params(config), max_shard_tensors=5)
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="model-00002"):
        load_params(tmp_path, config)


def test_untied_checkpoint_needs_lm_head(tmp_path):
    tied = tiny_config()
    save_hf_checkpoint(tmp_path, tied, random_params(tied))
    untied = ModelConfig.from_hf(tied.to_hf() | {"tie_word_embeddings": False})
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_params(tmp_path, untied)


def test_no_safetensors_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_params(tmp_path, tiny_config())


def _word_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|eot|>": 3, "hello": 4, "world": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))


def test_tokenizer_eos_prefers_generation_config(tmp_path):
    _word_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    tok = load_hf_tokenizer(tmp_path, config_eos_ids=(2,))
    assert tok.eos_token_ids == (2, 3)
    assert tok.encode("hello world") == [4, 5]
    assert tok.decode([4, 5]) == "hello world"


def test_tokenizer_eos_falls_back_to_config_then_tokenizer_config(tmp_path):
    _word_tokenizer(tmp_path)
    assert load_hf_tokenizer(tmp_path, config_eos_ids=(2,)).eos_token_ids == (2,)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|eot|>"}}))
    assert load_hf_tokenizer(tmp_path).eos_token_ids == (3,)


def test_chat_template_from_tokenizer_config_or_jinja_file(tmp_path):
    _word_tokenizer(tmp_path)
    assert load_hf_tokenizer(tmp_path).chat_template is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert load_hf_tokenizer(tmp_path).chat_template == "{{ messages }}"
    (tmp_path / "chat_template.jinja").write_text("from file")
    assert load_hf_tokenizer(tmp_path).chat_template == "from file"
