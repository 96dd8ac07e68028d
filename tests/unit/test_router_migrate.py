"""Decode migration's body surgery without processes: which requests migrate, the continued request, and the splice
of the new stream onto what the client already has."""

from __future__ import annotations

import json

from fsm_pd.api.router_migrate import Progress, can_migrate, continued_body


def data(doc: dict) -> str:
    return "data: " + json.dumps(doc)


def chunk(ids: list[int], text: str, finish=None, prompt=3) -> str:
    return data({"text": text, "output_ids": ids, "meta_info": {
        "finish_reason": finish, "prompt_tokens": prompt, "completion_tokens": len(ids)}})


def test_only_single_generate_streams_without_logprobs_migrate():
    base = {"text": "hi", "stream": True}
    assert can_migrate("/generate", base)
    assert can_migrate("/generate", {"input_ids": [1, 2], "stream": True})
    assert not can_migrate("/v1/chat/completions", base)
    assert not can_migrate("/generate", {**base, "stream": False})
    assert not can_migrate("/generate", {**base, "return_logprob": True})
    assert not can_migrate("/generate", {**base, "sampling_params": {"n": 2}})
    assert not can_migrate("/generate", {"text": ["a", "b"], "stream": True})
    assert not can_migrate("/generate", {"input_ids": [[1], [2]], "stream": True})


def test_the_continued_request_carries_prompt_and_sent_tokens_and_fewer_new_ones():
    body = {"text": "hi", "stream": True, "rid": "r", "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    out = continued_body(body, [5, 6, 7], [40, 41])
    assert out["input_ids"] == [5, 6, 7, 40, 41] and "text" not in out
    assert out["sampling_params"] == {"max_new_tokens": 8, "temperature": 0}
    assert out["rid"] == "r" and body["sampling_params"]["max_new_tokens"] == 10  # the client's body is untouched
    assert continued_body({"input_ids": [1], "stream": True}, [1], [2])["sampling_params"]["max_new_tokens"] == 127


def test_the_splice_sends_every_token_once():
    progress = Progress()
    first = [progress.splice(chunk([40], "a")), progress.splice(chunk([40, 41], "ab"))]
    assert [json.loads(line[6:])["output_ids"] for line in first] == [[40], [40, 41]]
    progress.cut()  # the decode died; the new one continues from prompt + [40, 41]
    line = progress.splice(chunk([42], "c", prompt=5))
    doc = json.loads(line[6:])
    assert doc["output_ids"] == [40, 41, 42] and doc["text"] == "abc"
    assert doc["meta_info"]["completion_tokens"] == 3 and doc["meta_info"]["prompt_tokens"] == 3
    assert not progress.finished
    progress.splice(chunk([42, 43], "cd", finish={"type": "length"}, prompt=5))
    assert progress.finished and progress.ids == [40, 41, 42, 43]


def test_the_splice_leaves_other_lines_alone():
    progress = Progress()
    for line in ("", ": keep-alive", "data: [DONE]", 'data: {"error": {"message": "x"}}', "data: not json"):
        assert progress.splice(line) == line
