"""``--role pd`` on one pool: while the prefill engine has a prompt to prefill, the decode engine's dispatches run one
step each (``DecodeLoop``'s rule for a first token waiting), so the prompt's chunk, which runs on the same device
right after the decode engine's dispatch, never queues behind K decode steps. The engines are the ones
``serve_pd.build_engines`` makes for ``--decode-steps-per-dispatch 8`` (the tiny model)."""

from __future__ import annotations

import pytest

from fsm_pd.cli.flags import role_parser
from fsm_pd.cli.serve_pd import build_engines
from fsm_pd.model.loader import load_model


@pytest.fixture
def engines(tmp_path):
    parser, words = role_parser(["--role", "pd", "--model", "tiny", "--journal-dir", str(tmp_path / "j"),
                                 "--decode-steps-per-dispatch", "8", "--page-size", "4"])
    args = parser.parse_args(words)
    model = load_model("tiny")
    prefill, decode = build_engines(args, {"prefill": model, "decode": model}, str(tmp_path), (32, 32))
    yield prefill, decode
    decode.close()
    prefill.close()


def test_a_prompt_the_prefill_engine_holds_makes_the_decode_engines_next_dispatch_one_step(engines):
    prefill, decode = engines
    assert decode.loop.steps_per_dispatch == 8
    assert not decode.loop.first_token_waiting()
    # a prompt that reached the prefill engine before its decode half reached the decode engine: no decode room
    # tells the decode side of it; only the shared pool does. Asked on the model thread, where the engines' steps
    # run, so no step takes the stand-in prompt meanwhile.

    def asked_with_a_prompt_in(name: str) -> tuple[bool, bool]:
        queue = getattr(prefill, name)  # read here: a step replaces the list of prompts being chunked
        queue.append(object())
        try:
            with_prompt = decode.loop.first_token_waiting()
        finally:
            queue.clear()
        return with_prompt, decode.loop.first_token_waiting()

    for name in ("arrivals", "_to_prefill", "_chunking"):
        asked = prefill.model_thread.submit(lambda _owner, n=name: asked_with_a_prompt_in(n))
        assert asked.result(30) == (True, False)
