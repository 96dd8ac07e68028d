"""Decode migration's stream bookkeeping without processes: which requests migrate, what the router takes out of
each chunk (the ids it carried, the seed, the finish), and the body that continues the stream."""

from __future__ import annotations

import json

from fsm_pd.router.migrate import Progress, can_migrate


def data(doc: dict) -> str:
    return "data: " + json.dumps(doc)


def test_single_streams_without_logprobs_migrate_on_every_api():
    base = {"text": "hi", "stream": True}
    assert can_migrate("/generate", base)
    assert can_migrate("/generate", {"input_ids": [1, 2], "stream": True})
    assert not can_migrate("/generate", {**base, "stream": False})
    assert not can_migrate("/generate", {**base, "return_logprob": True})
    assert not can_migrate("/generate", {**base, "sampling_params": {"n": 2}})
    assert not can_migrate("/generate", {"text": ["a", "b"], "stream": True})
    assert not can_migrate("/generate", {"input_ids": [[1], [2]], "stream": True})
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert can_migrate("/v1/chat/completions", chat)
    assert can_migrate("/v1/chat/completions", {**chat, "logprobs": False, "n": 1})
    assert not can_migrate("/v1/chat/completions", {**chat, "logprobs": True})
    assert not can_migrate("/v1/chat/completions", {**chat, "n": 2})
    assert not can_migrate("/v1/chat/completions", {**chat, "stream": False})
    completion = {"prompt": "hi", "stream": True}
    assert can_migrate("/v1/completions", completion)
    assert can_migrate("/v1/completions", {"prompt": [1, 2, 3], "stream": True})
    assert not can_migrate("/v1/completions", {"prompt": ["a", "b"], "stream": True})
    assert not can_migrate("/v1/completions", {**completion, "logprobs": 0})
    assert not can_migrate("/v1/completions", {**completion, "best_of": 2})
    assert not can_migrate("/v1/completions", {**completion, "echo": True})
    assert not can_migrate("/tokenize", base)


def test_the_router_keeps_the_ids_and_seed_and_the_client_gets_the_chunk_without_them():
    progress = Progress()
    first = {"id": "chatcmpl-r", "choices": [{"index": 0, "delta": {"content": "ab"}, "finish_reason": None}],
             "fsm_pd_progress": {"ids": [40, 41], "seed": 7}}
    line = progress.relay(data(first))
    assert json.loads(line[6:]) == {k: v for k, v in first.items() if k != "fsm_pd_progress"}
    assert progress.ids == [40, 41] and progress.seed == 7 and not progress.finished
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            "fsm_pd_progress": {"ids": [42], "seed": 7}}
    progress.relay(data(last))
    assert progress.ids == [40, 41, 42] and progress.finished
    usage = data({"choices": [], "usage": {"prompt_tokens": 3}})
    assert progress.relay(usage) == usage  # a chunk without the field goes out as it came


def test_a_generate_chunk_finishes_by_its_meta_info():
    progress = Progress()
    progress.relay(data({"text": "a", "output_ids": [5], "meta_info": {"finish_reason": None},
                         "fsm_pd_progress": {"ids": [5], "seed": 1}}))
    assert not progress.finished
    progress.relay(data({"text": "ab", "output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}},
                         "fsm_pd_progress": {"ids": [6], "seed": 1}}))
    assert progress.finished and progress.ids == [5, 6]


def test_the_continued_request_is_the_clients_with_the_ids_so_far():
    progress = Progress()
    progress.relay(data({"text": "x", "fsm_pd_progress": {"ids": [9, 10], "seed": 123}}))
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "rid": "r", "max_tokens": 10}
    out = progress.continued(body)
    assert out == {**body, "fsm_pd_resume": {"output_ids": [9, 10], "seed": 123}}
    assert "fsm_pd_resume" not in body  # the client's body is untouched


def test_a_stream_the_client_has_nothing_of_goes_again_as_the_client_sent_it():
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "rid": "r", "max_tokens": 10}
    progress = Progress()
    progress.relay("")  # not an event: the client still has nothing, and a resume would leave out the role chunk
    assert progress.continued(body) == body
    progress.relay(data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    assert progress.continued(body) == {**body, "fsm_pd_resume": {"output_ids": [], "seed": None}}  # it has the head


def test_other_lines_pass_unchanged():
    progress = Progress()
    for line in ("", ": keep-alive", "data: [DONE]", 'data: {"error": {"message": "x"}}', "data: not json"):
        assert progress.relay(line) == line
    assert progress.ids == [] and not progress.finished
