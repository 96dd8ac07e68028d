"""The model calls a scheduler makes on the model thread: prefill a batch of prompts and sample each one's first
token, and the logprobs of chosen tokens. Shared by the prefill and colocated engines, so both sample the first
token the same way (the request's seed, step 0) and a PD pair answers exactly like a colocated node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fsm_pd.model.grammar import new_state
from fsm_pd.model.loader import LoadedModel
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.model.sampling import sample
from fsm_pd.serving.top_logprobs import TopRow, chosen_and_top, log_softmax_rows
from fsm_pd.serving.types import GenerateRequest


@dataclass(frozen=True, slots=True)
class FirstToken:
    token_id: int
    logprob: float | None  # only when the request asked for logprobs
    input_logprobs: list[float | None] | None
    top_logprobs: TopRow | None = None  # the first output token's alternatives, when asked for
    input_top_logprobs: list[TopRow | None] | None = None  # the prompt's, None at its first position


def chosen_logprobs(logits, tokens) -> np.ndarray:
    """``log_softmax(logits)[b, tokens[b]]`` for each row; on the host, where it costs one pass over ``[B, V]``
    and compiles nothing per batch size."""
    return log_softmax_rows(logits)[np.arange(np.asarray(logits).shape[0]), np.asarray(tokens)]


def top_ks(requests: Sequence[GenerateRequest]) -> list[int]:
    """Each request's k: its ``top_logprobs_num`` when it asked for logprobs at all, else 0."""
    return [r.top_logprobs_num if r.return_logprob else 0 for r in requests]


def prefill_and_sample(
    model: LoadedModel, owner: ModelThread, requests: Sequence[GenerateRequest], pages: Sequence[Sequence[int]],
    starts: Sequence[int] | None = None,
) -> list[FirstToken]:
    """Prefill ``requests`` into ``pages`` (one list each) in one batch; model thread only (it replaces the pool).
    ``starts[i]``: how many leading prompt tokens already have their KV in ``pages[i]`` (a cached prefix)."""
    want_logprobs = any(r.return_logprob for r in requests)
    ks = top_ks(requests)
    starts = list(starts) if starts is not None else [0] * len(requests)
    out = model.prefill_batch(  # the bucket's rows: no program per batch size (model/decoder.py)
        owner.pool, [r.input_ids[start:] for r, start in zip(requests, starts, strict=True)],
        [list(p) for p in pages], start_positions=starts, return_logprobs=want_logprobs, top_logprobs=ks,
        bucket_rows=True,
    )
    owner.pool = out.pool
    # A request's grammar masks its first token here too; the decode (or colocated) side's own parser is fed it next.
    # A migrated stream's first token here follows the tokens it generated before: the step, penalties and grammar
    # count them.
    grammars = [_grammar_after(r, model.tokenizer) for r in requests]
    tokens = sample(out.logits, [r.sampling for r in requests], [r.seed for r in requests],
                    [len(r.generated_before) for r in requests], histories=[r.generated_before for r in requests],
                    grammars=grammars)
    logprobs, tops = (chosen_and_top(np.asarray(out.logits)[: len(requests)], tokens, ks) if want_logprobs
                      else (None, None))
    return [
        FirstToken(
            int(tokens[i]),
            float(logprobs[i]) if r.return_logprob else None,
            out.token_logprobs[i] if r.return_logprob else None,
            tops[i] if ks[i] else None,
            out.token_top_logprobs[i] if ks[i] else None,
        )
        for i, r in enumerate(requests)
    ]


def _grammar_after(request: GenerateRequest, tokenizer):
    if not request.sampling.grammar:
        return None
    state = new_state(request.sampling.grammar, tokenizer)
    for token_id in request.generated_before:
        state.advance(token_id)
    return state


# READY carries the prompt's logprobs as a list of floats; the first prompt token has none (nothing precedes it),
# so the wire form leaves that entry out and the decode side puts the None back.
def input_logprobs_to_wire(logprobs: list[float | None] | None) -> list[float] | None:
    return None if logprobs is None else [float(x) for x in logprobs[1:]]


def input_logprobs_from_wire(logprobs: list[float] | None) -> list[float | None] | None:
    return None if logprobs is None else [None, *logprobs]
