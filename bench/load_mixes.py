"""The load bench's traffic and its arithmetic (``load.py``): the three mixes, prompts of a known token count for the
model's own tokenizer, and the figures of a run (percentiles, SLO attainment, goodput).

A prompt is a chat of two messages: a system message holding a tag unique to the request (so that no two prompts share
a first KV page and the prefix cache never serves one prompt from another), and a user message of random decimal
digits. Digits, because three counts agree on them: SmolLM2's tokenizer and the tiny model's byte tokenizer both make
one token of each digit, and so does the built-in router's estimate (``router/policy.py``), which decides where
``--pd-policy auto`` sends a request. How many digits give the wanted count is measured on the server (``PromptPlan``:
the template's overhead and the tokens per digit, from two probes' ``usage.prompt_tokens``), and every answer's
``prompt_tokens`` is checked against the plan.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

LONG, SHORT = "long", "short"


@dataclass(frozen=True)
class Mix:
    name: str
    long_share: float  # the share of requests with a long prompt; the rest are short
    max_tokens: int  # new tokens per request (ignore_eos: exactly this many)

    def kinds(self, count: int) -> list[str]:
        """The kind of each of ``count`` requests: every k-th long for a share of 1/k, so that the long ones spread
        evenly through the run (and a run of 3 has its one long request)."""
        if self.long_share >= 1:
            return [LONG] * count
        if self.long_share <= 0:
            return [SHORT] * count
        every = round(1 / self.long_share)
        return [LONG if i % every == 0 else SHORT for i in range(count)]

    def kinds_present(self) -> list[str]:
        return [k for k, present in ((LONG, self.long_share > 0), (SHORT, self.long_share < 1)) if present]


# The three mixes (issue 48, point 7); the prompt lengths of the kinds are the plan's (PromptPlan.lengths)
MIXES = {"prefill-heavy": Mix("prefill-heavy", 1.0, 16),
         "decode-heavy": Mix("decode-heavy", 0.0, 128),
         "mixed": Mix("mixed", 1 / 3, 48)}


@dataclass(frozen=True)
class PromptPlan:
    """How a prompt of a given token count is written for the served model: ``overhead`` tokens of chat template and
    tag, then ``per_digit`` tokens per digit of the user message (1 for SmolLM2 and the tiny model)."""
    overhead: int
    per_digit: float
    lengths: dict  # kind -> the prompt tokens asked for

    def digits(self, kind: str) -> int:
        return max(0, round((self.lengths[kind] - self.overhead) / self.per_digit))

    def expected_tokens(self, kind: str) -> int:
        return self.overhead + round(self.digits(kind) * self.per_digit)


TAG_DIGITS = 6  # a fixed width, so that every tag costs the same tokens


def chat(tag: int, digits: int, seed: int) -> list[dict]:
    """The messages of one request: the tag, then ``digits`` random digits drawn from ``seed``."""
    rng = random.Random(seed)
    body = "".join(rng.choice("0123456789") for _ in range(digits))
    return [{"role": "system", "content": f"{tag:0{TAG_DIGITS}d}"}, {"role": "user", "content": body}]


def request_body(messages: list[dict], max_tokens: int, model: str | None = None, stream: bool = True) -> dict:
    """A streamed, greedy chat that generates exactly ``max_tokens`` (``ignore_eos``), its usage in the last chunk."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if model:
        body["model"] = model
    return body


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks (numpy's default); None for none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def isolated_slo(records: list[dict], ttft_scale: float, tpot_scale: float) -> dict:
    """Per kind, from requests sent one at a time: the median TTFT and TPOT, and the SLO they give (``ttft_scale`` x
    the TTFT, ``tpot_scale`` x the TPOT)."""
    slo = {}
    for kind in sorted({r["kind"] for r in records}):
        mine = [r for r in records if r["kind"] == kind and r["ok"]]
        if not mine:
            continue
        ttft = statistics.median(r["ttft_s"] for r in mine)
        tpot = statistics.median(r["tpot_s"] for r in mine)
        slo[kind] = {"isolated_ttft_s": ttft, "isolated_tpot_s": tpot, "ttft_s": ttft_scale * ttft,
                     "tpot_s": tpot_scale * tpot, "requests": len(mine)}
    return slo


def meets(record: dict, slo: dict) -> bool:
    """The request was answered in full within its kind's SLO (TTFT and TPOT both)."""
    limit = slo.get(record["kind"])
    return bool(record["ok"] and limit and record["ttft_s"] <= limit["ttft_s"] and record["tpot_s"] <= limit["tpot_s"])


def summary(records: list[dict], seconds: float, slo: dict | None) -> dict:
    """A mix's figures on one target: ``records`` (one per request, ``load_client.stream_chat``) sent over
    ``seconds`` of wall time."""
    ok = [r for r in records if r["ok"]]
    tokens = sum(r["completion_tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok if r["completion_tokens"] > 1]
    routes: dict[str, int] = {}
    for r in records:
        routes[r["route"] or "-"] = routes.get(r["route"] or "-", 0) + 1
    prompts = [r["prompt_tokens"] for r in ok]
    out = {"requests": len(records), "answered": len(ok), "seconds": seconds,
           "output_tokens": tokens, "output_tok_s": tokens / seconds if seconds > 0 else 0.0,
           "req_s": len(ok) / seconds if seconds > 0 else 0.0,
           "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
           "tpot_p50_s": percentile(tpot, 50), "tpot_p90_s": percentile(tpot, 90),
           "prompt_tokens": {"min": min(prompts, default=0), "median": statistics.median(prompts) if prompts else 0,
                             "max": max(prompts, default=0)},
           "routes": routes}
    if slo is not None:
        met = sum(meets(r, slo) for r in records)
        out |= {"slo_met": met, "attainment": met / len(records) if records else 0.0,
                "goodput_req_s": met / seconds if seconds > 0 else 0.0}
    return out


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``, or None where either is missing or the base is 0 (no ratio to speak of)."""
    if value is None or not base:
        return None
    return value / base


def ratios(target: dict, base: dict) -> dict:
    """One mix's figures on a target against the same mix on the baseline (colocated), measured in the same run."""
    return {"output_tok_s": ratio(target["output_tok_s"], base["output_tok_s"]),
            "goodput": ratio(target.get("goodput_req_s"), base.get("goodput_req_s")),
            "tpot_p90": ratio(target["tpot_p90_s"], base["tpot_p90_s"]),
            "ttft_p90": ratio(target["ttft_p90_s"], base["ttft_p90_s"])}


# the figures a mix's median over runs gives, each the median of the runs' own (a run's p90 is its own)
MEDIAN_FIGURES = ("seconds", "output_tokens", "output_tok_s", "req_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s",
                  "tpot_p90_s", "slo_met", "attainment", "goodput_req_s")


def median_of_runs(runs: list[dict]) -> dict:
    """One mix on one target over its runs (``summary`` each, of the same requests): each figure's median over the
    runs that have it, the requests of a run and the fewest any run answered, and where all runs were routed."""
    out: dict = {"runs": len(runs), "requests": max(r["requests"] for r in runs),
                 "answered": min(r["answered"] for r in runs), "routes": {}}
    for name in MEDIAN_FIGURES:
        values = [r[name] for r in runs if r.get(name) is not None]
        if values:
            out[name] = statistics.median(values)
        elif any(name in r for r in runs):
            out[name] = None
    for r in runs:
        for route, n in r["routes"].items():
            out["routes"][route] = out["routes"].get(route, 0) + n
    return out
