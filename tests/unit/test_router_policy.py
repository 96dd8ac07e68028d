"""The router's path policy (``fsm_pd/router/policy.py``): a pure function of what the router knows, and the alarm of
a fleet whose prefill nodes idle."""

import pytest

from fsm_pd.router.policy import (
    CHARS_PER_TOKEN,
    PolicySettings,
    PrefillIdleWatch,
    RouteInput,
    decide,
    prompt_tokens,
)

AUTO = PolicySettings("auto", 256)


def test_the_default_is_classic_pd():
    assert decide(PolicySettings(), RouteInput(4, exact=True)).path == "pd"


def test_short_prompts_go_local_long_ones_through_prefill():
    short = decide(AUTO, RouteInput(48, exact=True))
    assert (short.path, short.reason) == ("local", "48 prompt tokens <= 256")
    long = decide(AUTO, RouteInput(480, exact=True))
    assert (long.path, long.reason) == ("pd", "480 prompt tokens > 256")
    assert decide(AUTO, RouteInput(256, exact=True)).path == "local"  # the threshold is inclusive
    assert decide(AUTO, RouteInput(257, exact=True)).path == "pd"


def test_a_busier_prefill_side_takes_moderate_prompts_local():
    calm = decide(AUTO, RouteInput(400, exact=True, prefill_outstanding=1, decode_outstanding=1))
    busy = decide(AUTO, RouteInput(400, exact=True, prefill_outstanding=3, decode_outstanding=1))
    assert calm.path == "pd"
    assert busy.path == "local" and "prefill busier (3 in flight against decode's 1)" in busy.reason
    # beyond twice the threshold a queue at P does not matter: the prompt is too long for D
    assert decide(AUTO, RouteInput(513, exact=True, prefill_outstanding=9, decode_outstanding=0)).path == "pd"


def test_modes_and_a_fleet_without_prefill():
    assert decide(PolicySettings("always"), RouteInput(4, exact=True)).path == "pd"
    assert decide(PolicySettings("never"), RouteInput(4000, exact=True)).path == "local"
    gone = decide(AUTO, RouteInput(4000, exact=True, prefill_available=False))
    assert (gone.path, gone.reason) == ("local", "no healthy prefill worker")
    assert "estimated" in decide(AUTO, RouteInput(100, exact=False)).reason
    with pytest.raises(ValueError, match="--pd-policy"):
        PolicySettings("sometimes")
    with pytest.raises(ValueError, match="--local-prefill-max-tokens"):
        PolicySettings("auto", -1)


def test_prompt_length_from_what_the_router_sees():
    assert prompt_tokens({"input_ids": list(range(300))}) == (300, True)
    assert prompt_tokens({"input_ids": [[1, 2], [1, 2, 3]]}) == (3, True)
    assert prompt_tokens({"prompt": [5] * 7}) == (7, True)
    assert prompt_tokens({"text": "x" * 700}) == (round(700 / CHARS_PER_TOKEN), False)
    assert prompt_tokens({"prompt": ["ab" * 10, "c"]}) == (round(20 / CHARS_PER_TOKEN), False)
    assert prompt_tokens({"messages": [{"role": "user", "content": "y" * 35}]}) == (10, False)
    assert prompt_tokens({}) == (0, False)


def _fill(watch: PrefillIdleWatch, n: int, tokens: int, served: bool) -> None:
    for _ in range(n):
        entry = watch.entry(tokens)
        if served:
            watch.served(entry)
        watch.started(entry)


def test_idle_alarm_fires_when_prefill_served_nothing_of_long_prompts():
    watch = PrefillIdleWatch(AUTO, window=10)
    _fill(watch, 9, 480, served=False)
    assert not watch.alarm  # too little traffic to tell
    _fill(watch, 1, 480, served=False)
    assert watch.alarm  # ten long prompts, no prefill completed: the "PD" benchmark with an idle prefill engine
    _fill(watch, 1, 480, served=True)
    assert not watch.alarm  # one crossed


def test_idle_alarm_stays_off_for_short_prompts_sent_local():
    watch = PrefillIdleWatch(AUTO, window=10)
    _fill(watch, 30, 48, served=False)
    assert not watch.alarm  # the policy sent short prompts to the decode nodes, as it should


def test_idle_alarm_under_policy_always_fires_even_for_short_prompts():
    watch = PrefillIdleWatch(PolicySettings("always"), window=5)
    _fill(watch, 5, 48, served=False)
    assert watch.alarm


def test_a_prefill_that_completes_after_its_stream_started_still_counts():
    watch = PrefillIdleWatch(AUTO, window=3)
    entries = [watch.entry(480) for _ in range(3)]
    for entry in entries:
        watch.started(entry)
    assert watch.alarm
    watch.served(entries[1])  # _prefill_answered: the answer came beside the relay
    assert not watch.alarm
