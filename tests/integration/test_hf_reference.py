"""fsm-pd against transformers (torch, CPU) on small random Llama, Qwen2 and Qwen3 checkpoints.

Each model is built and saved by transformers (``save_pretrained``, safetensors) next to a ``tokenizer.json`` made
with the ``tokenizers`` library, then loaded by ``load_model`` from disk: the test covers config parsing, tensor
naming and transposes, the tokenizer, and the paged decoder, against code that no one here wrote.

Tolerance: both sides run float32 on the CPU with identical weights, so they differ only in the order of floating-point
sums (matmul blocking, softmax, RMSNorm reductions). The largest difference observed here is 7e-6 on logits of
magnitude up to ~5; we assert ``atol = rtol = 1e-4``, over 10x that, yet far below what a real bug does (a wrong
transpose, rope convention, mask or page index moves logits by O(0.1-1)).
Greedy tokens must match exactly. Our decode is fed the reference's greedy tokens (teacher forcing), so a near-tie
within the tolerance could not derail the rest of the comparison; the test checks that the reference's top-2 margin is
above 2 * ATOL at every step, so the token check is never a coin toss.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from real_parts import REFERENCE

from fsm_pd.model.loader import load_model

pytestmark = REFERENCE

ATOL = RTOL = 1e-4
DECODE_STEPS = 16
PAGE_SIZE = 4
PROMPT = "The quick brown fox jumps over the lazy dog, then naps."
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip

CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-llama3-rope-tied": (
        "LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True},
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),  # head_dim != hidden / heads, as in Qwen3
}  # fmt: skip


def write_tokenizer(directory) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [PROMPT, "Pack my box with five dozen liquor jugs.", "Sphinx of black quartz, judge my vow."] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": "{{ x }}"}))


def build_checkpoint(directory, case: str, *, max_shard_size=None):
    # torch and transformers imported where used: a worker that collects this module without running it skips them
    import torch
    import transformers

    config_cls, model_cls, extra = CASES[case]
    config = getattr(transformers, config_cls)(**TINY, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        # Every tensor random, norms and biases included (HF inits them to constants, which would hide a mapping bug).
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    write_tokenizer(directory)
    return model


def hf_greedy(model, ids: list[int], steps: int):
    """Prefill logits ``[S, V]`` and ``steps`` greedy tokens with their logits, through the HF KV cache."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        prefill_logits = out.logits[0].numpy()
        cache, logits = out.past_key_values, out.logits[0, -1]
        tokens, step_logits = [], []
        for _ in range(steps):
            token = int(torch.argmax(logits))
            tokens.append(token)
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[0, -1]
            step_logits.append(logits.numpy())
    return prefill_logits, tokens, np.stack(step_logits)


def fsm_decode(loaded, ids: list[int], forced: list[int]):
    """Prefill ``ids``, then decode the reference's tokens ``forced`` one by one; our logits before each."""
    total = len(ids) + len(forced)
    pool = loaded.make_pool(loaded.make_kv_layout(num_pages=2 * total // PAGE_SIZE + 4, page_size=PAGE_SIZE))
    pages = list(range(2 * total // PAGE_SIZE + 3, 0, -2))[: -(-total // PAGE_SIZE)]  # scattered, descending
    result = loaded.prefill(pool, ids, pages, return_logprobs=True)
    pool, logits = result.pool, np.asarray(result.logits)
    greedy, step_logits = [], []
    for i, token in enumerate(forced):
        greedy.append(int(np.argmax(logits)))
        out, pool = loaded.decode(pool, [token], [len(ids) + i], [pages])
        logits = np.asarray(out[0])
        step_logits.append(logits)
    return result, greedy, np.stack(step_logits)


@pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_greedy_decode_match_transformers(tmp_path, case):
    import torch
    import transformers

    model = build_checkpoint(tmp_path, case)
    loaded = load_model(str(tmp_path))
    assert loaded.config.family == case.split("-")[0]

    ids = loaded.tokenizer.encode(PROMPT)
    reference_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert ids == reference_tok.encode(PROMPT, add_special_tokens=False)
    assert loaded.tokenizer.decode(ids) == PROMPT
    assert 8 < len(ids) < len(PROMPT)  # BPE merges happened, and the prompt spans several pages

    hf_prefill, hf_tokens, hf_steps = hf_greedy(model, ids, DECODE_STEPS)
    ours, our_tokens, our_steps = fsm_decode(loaded, ids, hf_tokens)

    np.testing.assert_allclose(np.asarray(ours.logits), hf_prefill[-1], atol=ATOL, rtol=RTOL)
    hf_logprobs = torch.log_softmax(torch.from_numpy(hf_prefill), dim=-1).numpy()
    expected = [hf_logprobs[i, ids[i + 1]] for i in range(len(ids) - 1)]
    np.testing.assert_allclose(ours.token_logprobs[1:], expected, atol=ATOL, rtol=RTOL)
    chosen_from = np.concatenate([hf_prefill[-1:], hf_steps[:-1]])  # the logits each greedy token was picked from
    top2 = np.sort(chosen_from, axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 2 * ATOL, "near-tie in the reference: the token check would be a toss"
    assert our_tokens == hf_tokens
    np.testing.assert_allclose(our_steps, hf_steps, atol=ATOL, rtol=RTOL)


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path):
    single_dir, sharded_dir = tmp_path / "single", tmp_path / "sharded"
    build_checkpoint(single_dir, "qwen2")
    build_checkpoint(sharded_dir, "qwen2", max_shard_size="100KB")
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single, sharded = load_model(str(single_dir)), load_model(str(sharded_dir))
    ids = single.tokenizer.encode(PROMPT)
    pages = list(range(1, 6))
    a = single.prefill(single.make_pool(single.make_kv_layout(8, 4)), ids[:16], pages).logits
    b = sharded.prefill(sharded.make_pool(sharded.make_kv_layout(8, 4)), ids[:16], pages).logits
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sharded.eos_token_ids == (2,)
    assert sharded.tokenizer.chat_template == "{{ x }}"
