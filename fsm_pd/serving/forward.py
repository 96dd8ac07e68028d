"""The model calls a scheduler makes on the model thread: prefill a batch of prompts and sample each one's first
token (with its logprobs when the request asks). Shared by the prefill and colocated engines, so both sample the first
token the same way (the request's seed, step 0) and a PD pair answers exactly like a colocated node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from fsm_pd.model.grammar import new_state
from fsm_pd.model.input_buckets import batch_bucket
from fsm_pd.model.loader import LoadedModel
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.model.sampling import sample
from fsm_pd.scheduling.page_admission import Chunk, plan_chunks
from fsm_pd.serving.top_logprobs import TopRow, chosen_and_top
from fsm_pd.serving.types import GenerateRequest


@dataclass(frozen=True, slots=True)
class FirstToken:
    token_id: int
    logprob: float | None  # only when the request asked for logprobs
    input_logprobs: list[float | None] | None
    top_logprobs: TopRow | None = None  # the first output token's alternatives, when asked for
    input_top_logprobs: list[TopRow | None] | None = None  # the prompt's, None at its first position


def top_ks(requests: Sequence[GenerateRequest]) -> list[int]:
    """Each request's k: its ``top_logprobs_num`` when it asked for logprobs at all, else 0."""
    return [r.top_logprobs_num if r.return_logprob else 0 for r in requests]


def prefill_step(model: LoadedModel, owner: ModelThread, chunks: Sequence[Chunk]) -> list[FirstToken | None]:
    """Prefill one step's ``chunks`` (``page_admission.plan_chunks``) in one batch; model thread only (it replaces the
    pool). Each sequence's ``prefilled`` advances; a chunk that ends its prompt gets the prompt's first output token
    (sampled with the request's seed, at the step after the tokens it generated before), the others None. A
    request's prompt logprobs gather on its sequence chunk by chunk (each chunk also scores the next chunk's first
    token)."""
    seqs = [c.seq for c in chunks]
    requests = [s.request for s in seqs]
    want_logprobs = any(r.return_logprob for r in requests)
    ks = top_ks(requests)
    out = model.prefill_batch(  # the bucket's rows: no program per batch size (model/decoder.py)
        owner.pool, [s.request.input_ids[c.start:c.start + c.length] for s, c in zip(seqs, chunks, strict=True)],
        [s.pages for s in seqs], start_positions=[c.start for c in chunks], return_logprobs=want_logprobs,
        top_logprobs=ks, bucket_rows=True,
        following=[None if c.last else s.request.input_ids[c.start + c.length] for s, c in zip(seqs, chunks,
                                                                                                strict=True)],
    )
    owner.pool = out.pool
    for i, (seq, chunk) in enumerate(zip(seqs, chunks, strict=True)):
        seq.prefilled = chunk.start + chunk.length
        if requests[i].return_logprob:  # [None, lp(start + 1), ...]: the chunk's own first token was scored before
            seq.prompt_logprobs = (seq.prompt_logprobs or [None]) + out.token_logprobs[i][1:]
            if ks[i]:
                seq.prompt_top_logprobs = (seq.prompt_top_logprobs or [None]) + out.token_top_logprobs[i][1:]
    done = [i for i, c in enumerate(chunks) if c.last]
    firsts: list[FirstToken | None] = [None] * len(chunks)
    if not done:
        return firsts
    ended = [requests[i] for i in done]
    logits = out.logits if len(done) == len(chunks) else _rows(out.logits, done)
    # A request's grammar masks its first token here too; the decode (or colocated) side's own parser is fed it next.
    # A migrated stream's first token here follows the tokens it generated before: the step, penalties and grammar
    # count them.
    tokens = sample(logits, [r.sampling for r in ended], [r.seed for r in ended],
                    [len(r.generated_before) for r in ended], histories=[r.generated_before for r in ended],
                    grammars=[_grammar_after(r, model.tokenizer) for r in ended])
    ended_ks = [ks[i] for i in done]
    logprobs, tops = (chosen_and_top(np.asarray(logits)[: len(ended)], tokens, ended_ks)
                      if any(r.return_logprob for r in ended) else (None, None))
    for j, i in enumerate(done):
        seq, request = seqs[i], requests[i]
        firsts[i] = FirstToken(int(tokens[j]), float(logprobs[j]) if request.return_logprob else None,
                               seq.prompt_logprobs if request.return_logprob else None,
                               tops[j] if ended_ks[j] else None, seq.prompt_top_logprobs if ended_ks[j] else None)
    return firsts


def _rows(logits, rows: list[int]):
    """Some of a bucket's rows, as a bucket again and placed as the forward pass left them: picking them on the
    device, or handing the sampler a fresh host array, would each compile a program while serving."""
    picked = np.zeros((batch_bucket(len(rows)), logits.shape[-1]), np.float32)
    picked[: len(rows)] = np.asarray(logits)[rows]
    return jax.device_put(picked, logits.sharding)


@dataclass(slots=True)
class _Fill:
    tokens: list[int]
    pages: list[int]
    prefilled: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)


def fill_kv(model: LoadedModel, owner: ModelThread, items: Sequence[tuple[list[int], list[int]]], *, budget: int,
            max_batch: int) -> None:
    """Write the KV of each ``(tokens, pages)`` from position 0, in budget-sized chunk steps; no logits needed (a
    retracted sequence resuming). Model thread only."""
    fills = [_Fill(list(tokens), list(pages)) for tokens, pages in items]
    while pending := [f for f in fills if f.prefilled < f.prompt_len]:
        chunks = plan_chunks(pending, max_batch=max_batch, budget=budget)
        out = model.prefill_batch(owner.pool, [c.seq.tokens[c.start:c.start + c.length] for c in chunks],
                                  [c.seq.pages for c in chunks], start_positions=[c.start for c in chunks],
                                  bucket_rows=True)
        owner.pool = out.pool
        for c in chunks:
            c.seq.prefilled = c.start + c.length


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
