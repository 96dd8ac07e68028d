"""GGUF loading on small synthetic files written with ``gguf.GGUFWriter`` (llama.cpp's own writer).

Each file is written the way llama.cpp's converter writes a Llama: tensors in GGUF names, Q/K rows in llama.cpp's
rotary order (pairs adjacent, the reordering spelled out independently below), metadata under ``llama.*``, a
byte-level BPE vocabulary. Loading it must give back exactly the parameters it was made from.
"""

from __future__ import annotations

import gguf  # a dependency of fsm-pd (its writer and block formats)
import numpy as np
import pytest
from real_parts import SMOLLM2

from fsm_pd.model import gguf_file
from fsm_pd.model.config import ModelConfig, UnsupportedModelError
from fsm_pd.model.gguf_file import SUPPORTED_TYPES, GGUFError, dequantize, unpermute_rotary
from fsm_pd.model.gguf_reader import Tensor
from fsm_pd.model.loader import load_model
from fsm_pd.model.params import random_params

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "Ġ w"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def vocabulary() -> list[str]:
    from tokenizers import pre_tokenizers

    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "ll", "hell", "Ġw"]


def small_config(**overrides) -> ModelConfig:
    fields = dict(family="llama", vocab_size=len(vocabulary()), hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=50000.0,
                  max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
    return ModelConfig(**{**fields, **overrides})


def llama_cpp_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF's Q/K rows: each head's halves [a0..a3, b0..b3] -> a0 b0 a1 b1 ..."""
    head_dim = weight.shape[0] // heads
    out = np.empty_like(weight)
    for h in range(heads):
        for i in range(head_dim // 2):
            out[h * head_dim + 2 * i] = weight[h * head_dim + i]
            out[h * head_dim + 2 * i + 1] = weight[h * head_dim + head_dim // 2 + i]
    return out


def gguf_tensors(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """The parameter tree as GGUF-named float32 arrays in HF's [out, in] order, Q/K in llama.cpp's row order."""
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out = {"token_embd.weight": np.asarray(params["embed"]), "output_norm.weight": np.asarray(params["final_norm"])}
    if not config.tie_word_embeddings:
        out["output.weight"] = np.asarray(params["lm_head"]).T
    for i, layer in enumerate(params["layers"]):
        q, k, v = np.split(np.asarray(layer["wqkv"]).T, [q_out, q_out + kv_out])
        gate, up = np.split(np.asarray(layer["w_gate_up"]).T, 2)
        out.update({
            f"blk.{i}.attn_norm.weight": np.asarray(layer["attn_norm"]),
            f"blk.{i}.attn_q.weight": llama_cpp_order(q, config.num_heads),
            f"blk.{i}.attn_k.weight": llama_cpp_order(k, config.num_kv_heads),
            f"blk.{i}.attn_v.weight": v,
            f"blk.{i}.attn_output.weight": np.asarray(layer["wo"]).T,
            f"blk.{i}.ffn_norm.weight": np.asarray(layer["mlp_norm"]),
            f"blk.{i}.ffn_gate.weight": gate,
            f"blk.{i}.ffn_up.weight": up,
            f"blk.{i}.ffn_down.weight": np.asarray(layer["w_down"]).T,
        })  # fmt: skip
    return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in out.items()}


def write_gguf(path, config: ModelConfig, tensors: dict, *, arch="llama", qtypes=None, skip=(), tokenizer="gpt2",
               add_bos=False, raw=None):
    """Write ``tensors`` (float32, or quantized to ``qtypes[name]``; ``raw[name] = (bytes, type)`` as given)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model(tokenizer)
    writer.add_tokenizer_pre("smollm")
    tokens = vocabulary()
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TEMPLATE)
    for name, value in tensors.items():
        if name in skip:
            continue
        qtype = (qtypes or {}).get(name)
        if name in (raw or {}):
            writer.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
        elif qtype is None:
            writer.add_tensor(name, value)
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def made(tmp_path):
    config = small_config()
    params = random_params(config, seed=3, std=0.5)
    path = write_gguf(tmp_path / "m.gguf", config, gguf_tensors(config, params))
    return config, params, path


def test_metadata_maps_onto_the_config(made):
    config, _, path = made
    assert load_model(str(path)).config == config


def test_parameters_come_back_exactly_with_qk_rows_unpermuted(made):
    config, params, path = made
    loaded = load_model(str(path)).params
    for name in ("embed", "final_norm", "lm_head"):
        np.testing.assert_array_equal(loaded[name], params[name], err_msg=name)
    for i in range(config.num_layers):
        for name, value in params["layers"][i].items():
            np.testing.assert_array_equal(loaded["layers"][i][name], value, err_msg=f"layers[{i}].{name}")


def test_host_parameters_are_row_major(made):
    """As a converted entry reads them back: a transposed view would be copied by the save and the transfer."""
    from fsm_pd.model.gguf_file import load_gguf_params, open_gguf

    config, _, path = made
    params = load_gguf_params(open_gguf(path), config)
    leaves = [params[n] for n in params if n != "layers"] + [v for layer in params["layers"] for v in layer.values()]
    assert all(leaf.flags.c_contiguous for leaf in leaves)


def test_unpermute_inverts_llama_cpp_order():
    weight = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    np.testing.assert_array_equal(unpermute_rotary(llama_cpp_order(weight, 4), 4), weight)
    with pytest.raises(GGUFError, match="rotary pairs"):
        unpermute_rotary(np.zeros((30, 2)), 4)


def test_tied_embeddings_when_output_is_absent_and_bfloat16(tmp_path):
    config = small_config(tie_word_embeddings=True)
    params = random_params(config, seed=1)
    loaded = load_model(str(write_gguf(tmp_path / "t.gguf", config, gguf_tensors(config, params))), dtype="bfloat16")
    assert loaded.config.tie_word_embeddings and "lm_head" not in loaded.params
    assert loaded.params["embed"].dtype == "bfloat16" and loaded.config.dtype == "bfloat16"


def test_quantized_tensors_dequantize(tmp_path):
    config = small_config()
    tensors = gguf_tensors(config, random_params(config, seed=2))
    qtypes = {"blk.0.ffn_gate.weight": gguf.GGMLQuantizationType.Q8_0,  # blocks of 32 along the input (hidden) axis
              "blk.1.attn_v.weight": gguf.GGMLQuantizationType.F16}
    loaded = load_model(str(write_gguf(tmp_path / "q.gguf", config, tensors, qtypes=qtypes)))
    gate = np.asarray(loaded.params["layers"][0]["w_gate_up"])[:, : config.intermediate_size].T
    error = np.abs(gate - tensors["blk.0.ffn_gate.weight"]).max()
    assert 0 < error < 0.01 * np.abs(tensors["blk.0.ffn_gate.weight"]).max()  # Q8_0 rounds, by under 1%
    v = np.asarray(loaded.params["layers"][1]["wqkv"])[:, -config.num_kv_heads * config.head_dim:].T
    np.testing.assert_array_equal(v, tensors["blk.1.attn_v.weight"].astype(np.float16).astype(np.float32))


def test_tokenizer_from_metadata(made):
    _, _, path = made
    tok = load_model(str(path)).tokenizer
    vocab = vocabulary()
    assert tok.encode("hell") == [vocab.index("hell")]  # merges applied in order
    assert tok.encode("<|im_start|>he") == [1, vocab.index("he")]  # control tokens stay whole
    assert tok.encode("a w") == [vocab.index("a"), vocab.index("Ġw")]
    assert tok.decode(tok.encode("<|im_start|>hello wé<|im_end|>")) == "hello wé"
    assert tok.eos_token_ids == (2,) and tok.chat_template == TEMPLATE


def test_bos_is_added_when_the_file_asks(tmp_path):
    config = small_config()
    path = write_gguf(tmp_path / "b.gguf", config, gguf_tensors(config, random_params(config)), add_bos=True)
    tok = load_model(str(path)).tokenizer
    assert tok.encode("he") == [1, vocabulary().index("he")]
    assert tok.encode("he", add_special_tokens=False) == [vocabulary().index("he")]


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(GGUFError, match="bad.gguf is not a readable GGUF file"):
        load_model(str(bad))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model(str(tmp_path / "missing.gguf"))


def test_truncated_file(made, tmp_path):
    _, _, path = made
    short = tmp_path / "short.gguf"
    short.write_bytes(path.read_bytes()[: path.stat().st_size - 1000])
    with pytest.raises(GGUFError, match="short.gguf"):
        load_model(str(short))


def test_unsupported_tensor_type_is_named(tmp_path):
    config = small_config()
    tensors = gguf_tensors(config, random_params(config))
    # IQ4_NL blocks (32 values in 18 bytes), a format the gguf package reads but this loader refuses by name
    raw = {"blk.1.ffn_up.weight": (np.zeros((config.intermediate_size, config.hidden_size // 32 * 18), np.uint8),
                                   gguf.GGMLQuantizationType.IQ4_NL)}
    path = write_gguf(tmp_path / "iq.gguf", config, tensors, raw=raw)
    with pytest.raises(GGUFError, match=r"tensor 'blk\.1\.ffn_up\.weight' has type IQ4_NL"):
        load_model(str(path))


def test_missing_tensor_is_named(tmp_path):
    config = small_config()
    path = write_gguf(tmp_path / "m.gguf", config, gguf_tensors(config, random_params(config)),
                      skip={"blk.1.ffn_gate.weight"})
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_gate\.weight"):
        load_model(str(path))


def test_unsupported_architecture_and_tokenizer(tmp_path):
    config = small_config()
    tensors = gguf_tensors(config, random_params(config))
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        load_model(str(write_gguf(tmp_path / "a.gguf", config, tensors, arch="gpt2")))
    with pytest.raises(UnsupportedModelError, match="tokenizer 'llama'"):
        load_model(str(write_gguf(tmp_path / "t.gguf", config, tensors, tokenizer="llama")))


def random_tensor(kind: gguf.GGMLQuantizationType, rows: int, width: int, seed: int = 0) -> Tensor:
    """A reader tensor of ``rows`` x ``width`` values whose bytes are random: NaNs, infinities and subnormals among
    its scales and values, so the check below compares every bit, payloads too."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, width // block * block_bytes), dtype=np.uint8)
    data = {"F32": raw.view(np.float32), "F16": raw.view(np.float16)}.get(kind.name, raw)
    return Tensor("t", (width, rows), kind, data, 0)


NAN_CASTS = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaNs by design


@NAN_CASTS
@pytest.mark.parametrize("kind", SUPPORTED_TYPES)
@pytest.mark.parametrize("values_at_once", [None, 3700])  # the default slices; 7 rows a slice, the last of 5
def test_dequantizing_in_slices_gives_the_librarys_bits(monkeypatch, kind, values_at_once):
    import ml_dtypes

    kind = gguf.GGMLQuantizationType[kind]
    if values_at_once is not None:
        monkeypatch.setattr(gguf_file, "_VALUES_AT_ONCE", values_at_once)
    tensor = random_tensor(kind, rows=600, width=512)
    expected = gguf.quants.dequantize(tensor.data, kind).astype(np.float32, copy=False)
    got = dequantize(tensor)
    assert got.dtype == np.float32 and got.shape == (600, 512)
    assert got.view(np.uint32).tobytes() == expected.view(np.uint32).tobytes()
    as_bf16 = dequantize(tensor, ml_dtypes.bfloat16)
    assert as_bf16.view(np.uint16).tobytes() == expected.astype(ml_dtypes.bfloat16).view(np.uint16).tobytes()


@NAN_CASTS
def test_every_16_bit_pattern_casts_to_bfloat16_as_through_float32():
    """F16 and BF16 tensors are cast to bfloat16 a slice at a time: each of their 65,536 bit patterns (NaNs among
    them) lands on the bits that a whole float32 copy, cast, gives."""
    import ml_dtypes

    patterns = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    for kind, values in ((gguf.GGMLQuantizationType.F16, patterns.view(np.float16)),
                         (gguf.GGMLQuantizationType.BF16, patterns.view(np.uint8))):
        tensor = Tensor("t", (256, 256), kind, values, 0)
        expected = gguf.quants.dequantize(values, kind).astype(ml_dtypes.bfloat16)
        assert dequantize(tensor, ml_dtypes.bfloat16).view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()


def test_bfloat16_parameters_are_the_float32_ones_cast(tmp_path):
    """Loading in bfloat16 casts each tensor as it is dequantized; the tree is the float32 load's, cast, bit for bit,
    whatever the tensors' types."""
    config = small_config()
    tensors = gguf_tensors(config, random_params(config, seed=5))
    Q = gguf.GGMLQuantizationType
    qtypes = {"blk.0.ffn_gate.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_1, "blk.1.attn_v.weight": Q.F16,
              "blk.1.ffn_up.weight": Q.Q5_0, "token_embd.weight": Q.BF16}
    path = str(write_gguf(tmp_path / "q.gguf", config, tensors, qtypes=qtypes))
    assert_bfloat16_is_float32_cast(load_model(path).params, load_model(path, dtype="bfloat16").params)


@SMOLLM2
def test_smollm2_in_bfloat16_is_its_float32_cast():
    from fsm_pd.model.gguf_file import config_from_gguf, load_gguf_params, open_gguf
    from fsm_pd.model.specs import resolve_named_model

    reader = open_gguf(resolve_named_model("smollm2"))
    as_f32, as_bf16 = (load_gguf_params(reader, config_from_gguf(reader, dtype=d)) for d in ("float32", "bfloat16"))
    assert_bfloat16_is_float32_cast(as_f32, as_bf16)


def assert_bfloat16_is_float32_cast(as_f32: dict, as_bf16: dict) -> None:
    import ml_dtypes

    pairs = [(name, as_f32[name], as_bf16[name]) for name in as_f32 if name != "layers"]
    pairs += [(f"layers[{i}].{name}", value, as_bf16["layers"][i][name])
              for i, layer in enumerate(as_f32["layers"]) for name, value in layer.items()]
    for name, f32, bf16 in pairs:
        assert bf16.dtype == ml_dtypes.bfloat16 and bf16.shape == f32.shape, name
        cast = np.ascontiguousarray(np.asarray(f32).astype(ml_dtypes.bfloat16))
        assert np.ascontiguousarray(bf16).view(np.uint16).tobytes() == cast.view(np.uint16).tobytes(), name
