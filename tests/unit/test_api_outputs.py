"""RequestState: what streamed text may show before a request ends, and SGLang's logprob shapes."""

from __future__ import annotations

from stub_engine import stub_tokenizer

from fsm_pd.api.outputs import RequestState, openai_finish_reason
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.serving.types import GenerateRequest, TokenOutput


def state(stop=(), input_ids=(1, 2, 3)) -> RequestState:
    request = GenerateRequest(rid="r", input_ids=list(input_ids), sampling=SamplingParams(stop=stop), seed=0,
                              return_logprob=True)
    return RequestState(request, stub_tokenizer())


def feed(s: RequestState, data: bytes) -> None:
    for b in data:
        s.add(TokenOutput(token_id=b, logprob=-0.5))


def test_partial_utf8_is_held_back_until_complete():
    s = state()
    feed(s, "é".encode()[:1])
    assert s.take_delta() == ""
    feed(s, "é".encode()[1:])
    assert s.take_delta() == "é"


def test_possible_stop_string_prefix_is_held_back():
    s = state(stop=("END",))
    feed(s, b"abE")
    assert s.take_delta() == "ab"
    feed(s, b"x")
    assert s.take_delta() == "Ex"


def test_final_text_comes_from_the_engine():
    s = state(stop=("END",))
    feed(s, b"abEN")
    s.add(TokenOutput(token_id=ord("D"), finish_reason={"type": "stop", "matched": "END"}, text="ab"))
    assert s.take_delta() == "ab" and s.text() == "ab"


def test_logprob_shapes_pad_the_first_prompt_token():
    s = state(input_ids=(5, 6, 7))
    s.add(TokenOutput(token_id=9, logprob=-1.5, input_token_logprobs=[-0.1, -0.2],
                      finish_reason={"type": "length", "length": 1}))
    meta = s.sglang_meta()
    assert meta["input_token_logprobs"] == [[None, 5, None], [-0.1, 6, None], [-0.2, 7, None]]
    assert meta["output_token_logprobs"] == [[-1.5, 9, None]]


def test_openai_finish_reasons():
    assert openai_finish_reason({"type": "length", "length": 3}) == "length"
    assert openai_finish_reason({"type": "stop", "matched": 2}) == "stop"
    assert openai_finish_reason({"type": "abort", "message": "x"}) == "abort"
    assert openai_finish_reason(None) is None
