"""bench/load_mixes.py, the load bench's arithmetic: which requests of a mix are long, how many digits make a prompt of
the planned length, percentiles, and which requests meet the SLO."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

# appended, not put first: a bench module must never shadow an installed package for the rest of the run
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
from load_mixes import LONG, MIXES, SHORT, PromptPlan, chat, isolated_slo, percentile, ratio, summary  # noqa: E402

from fsm_pd.model.tiny import tiny_model_parts  # noqa: E402
from fsm_pd.model.tokenizer import render_chat  # noqa: E402


def test_the_mixed_mix_has_every_third_request_long_and_the_others_one_kind():
    assert MIXES["mixed"].kinds(7) == [LONG, SHORT, SHORT, LONG, SHORT, SHORT, LONG]
    assert set(MIXES["prefill-heavy"].kinds(5)) == {LONG} and set(MIXES["decode-heavy"].kinds(5)) == {SHORT}
    assert [m.max_tokens for m in MIXES.values()] == [16, 128, 48]


def test_a_planned_prompt_has_the_planned_tokens_under_the_tiny_model_s_template():
    _, _, tokenizer = tiny_model_parts()

    def tokens(digits: int, tag: int = 7) -> int:
        return len(tokenizer.encode(render_chat(tokenizer.chat_template, chat(tag, digits, seed=tag))))

    plan = PromptPlan(tokens(0), (tokens(200) - tokens(0)) / 200, {LONG: 900, SHORT: 30})
    assert plan.per_digit == 1.0
    for kind in (LONG, SHORT):
        for tag in (0, 123_456):  # a tag of any value costs the same
            assert tokens(plan.digits(kind), tag) == plan.expected_tokens(kind)
    assert plan.expected_tokens(LONG) == 900
    assert plan.expected_tokens(SHORT) == max(30, plan.overhead)  # never fewer digits than none


def test_two_chats_with_different_tags_differ_from_their_first_token_on():
    a, b = chat(1, 50, seed=1), chat(2, 50, seed=2)
    assert a[0]["content"] != b[0]["content"] and a[1]["content"] != b[1]["content"]
    assert chat(1, 50, seed=1) == a  # the same on every target


@pytest.mark.parametrize("q", [0, 10, 50, 90, 100])
def test_percentile_interpolates_as_numpy_does(q):
    values = [5.0, 1.0, 9.0, 2.5, 7.0, 3.0]
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], q) is None


def _record(kind, ttft, tpot, ok=True, tokens=16):
    return {"kind": kind, "ok": ok, "ttft_s": ttft, "tpot_s": tpot, "completion_tokens": tokens if ok else 0,
            "prompt_tokens": 900, "route": "pd"}


def test_goodput_counts_the_requests_within_both_limits_of_their_own_kind():
    slo = isolated_slo([_record(LONG, 0.2, 0.01), _record(LONG, 0.4, 0.03), _record(SHORT, 0.01, 0.002)], 5, 2)
    assert slo[LONG]["ttft_s"] == pytest.approx(1.5) and slo[LONG]["tpot_s"] == pytest.approx(0.04)
    records = [_record(LONG, 1.4, 0.039),  # met
               _record(LONG, 1.6, 0.01),  # TTFT over
               _record(SHORT, 0.05, 0.005),  # TPOT over (0.004)
               _record(SHORT, 0.04, 0.003),  # met
               _record(SHORT, 0.01, 0.001, ok=False)]  # unanswered: never met
    figures = summary(records, 2.0, slo)
    assert figures["slo_met"] == 2 and figures["goodput_req_s"] == 1.0 and figures["attainment"] == 0.4
    assert figures["answered"] == 4 and figures["output_tokens"] == 64 and figures["output_tok_s"] == 32.0
    assert ratio(2.0, 0.0) is None and ratio(None, 1.0) is None and ratio(3.0, 2.0) == 1.5
