"""The tokenizer a GGUF file describes, rebuilt with the ``tokenizers`` library.

Byte-level BPE only (``tokenizer.ggml.model = "gpt2"``, what Llama 3, Qwen and SmolLM files carry): the vocabulary
is ``tokenizer.ggml.tokens`` (index = id), the merges ``tokenizer.ggml.merges`` (``"left right"``), and tokens typed
CONTROL (3) become special tokens, so ``<|im_start|>`` in a rendered chat template encodes as one id and
``skip_special_tokens`` drops them. ``tokenizer.ggml.pre`` names how llama.cpp splits text before BPE; the table
below holds the splits of the families this engine runs.
"""

from __future__ import annotations

import logging

from fsm_pd.model.config import UnsupportedModelError
from fsm_pd.model.gguf_file import GGUFError, field
from fsm_pd.model.tokenizer import HFTokenizer

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes applied in turn (each piece of one split is split again by the next)
PRE_TOKENIZER_SPLITS = {
    "default": (_GPT2,),
    "gpt-2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),  # every digit alone, then GPT-2's split (as SmolLM's own tokenizer.json)
    "starcoder": (r"\p{N}", _GPT2),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
}


def tokenizer_from_gguf(reader, *, path: str = "") -> HFTokenizer:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(f"{path}: GGUF tokenizer {kind!r} is not supported (only byte-level BPE, "
                                    "tokenizer.ggml.model = 'gpt2')")
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = field(reader, "tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise GGUFError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise GGUFError(f"{path}: tokenizer.ggml.merges entry {merge!r} is not 'left right'")
        pairs.append((left, right))
    inner = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs))

    pre = field(reader, "tokenizer.ggml.pre", "default")
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        log.warning("%s: unknown tokenizer.ggml.pre %r; splitting text as GPT-2 does", path, pre)
        splits = (_GPT2,)
    inner.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens([AddedToken(t, special=True, normalized=False)
                              for t, ttype in zip(tokens, types, strict=True) if ttype == CONTROL])
    inner.add_tokens([AddedToken(t, special=False, normalized=False)
                      for t, ttype in zip(tokens, types, strict=True) if ttype == USER_DEFINED])

    bos = field(reader, "tokenizer.ggml.bos_token_id")
    if field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_text = tokens[int(bos)]
        inner.post_processor = processors.TemplateProcessing(
            single=f"{bos_text} $A", pair=f"{bos_text} $A $B", special_tokens=[(bos_text, int(bos))])
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    eot = field(reader, "tokenizer.ggml.eot_token_id")  # end of turn, when a file names it apart from EOS
    eos_ids = tuple(dict.fromkeys(int(i) for i in (eos, eot) if i is not None))
    return HFTokenizer(inner, eos_token_ids=eos_ids, chat_template=field(reader, "tokenizer.chat_template"))
