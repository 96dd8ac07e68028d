"""The built-in ``tiny`` model: a 2-layer Llama with fixed-seed random weights and a byte-level tokenizer.

It exists so that the whole stack (server, transfer, tests) runs with no download. Its output is gibberish, but the
same gibberish on every machine: the weights come from a seeded numpy generator.
"""

from __future__ import annotations

from fsm_pd.model.config import ModelConfig
from fsm_pd.model.params import random_params
from fsm_pd.model.tokenizer import ByteTokenizer

TINY_SEED = 0
# Larger than the usual 0.02 so that the logits are far from uniform and greedy decoding is not a coin toss on ties.
TINY_INIT_STD = 0.1

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_config(dtype: str = "float32") -> ModelConfig:
    tokenizer = ByteTokenizer(vocab_size=272)
    return ModelConfig(
        family="llama",
        vocab_size=tokenizer.vocab_size,  # 256 bytes + 4 specials, rounded up to a multiple of 16
        hidden_size=64,
        intermediate_size=160,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        dtype=dtype,
        eos_token_ids=tokenizer.eos_token_ids,
    )


def tiny_model_parts(dtype: str = "float32"):
    """``(config, params, tokenizer)`` of the tiny model."""
    config = tiny_config(dtype)
    tokenizer = ByteTokenizer(vocab_size=config.vocab_size, chat_template=CHATML_TEMPLATE)
    return config, random_params(config, seed=TINY_SEED, std=TINY_INIT_STD), tokenizer
