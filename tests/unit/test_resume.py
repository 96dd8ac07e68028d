"""A migrated stream, node side: a node given ``fsm_pd_resume`` (the ids a broken stream carried) continues it so
that what the client has plus what follows equals the undisturbed stream. The tiny model on a colocated engine
behind the real app (127.0.0.1, or a unix socket on a host without TCP); the router's own bookkeeping
(``router.migrate.Progress``) reads the chunks, and the stream is cut before its first chunk and after every chunk
in turn.

The tiny model's tokenizer is byte-level and its greedy bytes are mostly not UTF-8, which a stream holds back to the
end; a logit bias keeps it to lowercase letters and spaces, so every token is a chunk. The stop-string case puts a
stop string across the cut, and the text a node held back as a possible stop-string start is sent after it."""

from __future__ import annotations

import json

import pytest
from node_sockets import node_sockets

from fsm_pd.api import AppServer, create_app
from fsm_pd.api.streaming import PROGRESS_HEADER
from fsm_pd.model.loader import load_model
from fsm_pd.net import unix_http
from fsm_pd.router.migrate import Progress
from fsm_pd.serving.colocated_engine import ColocatedEngine

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = pytest.mark.usefixtures("full_precision")

TOKENS = 12
LETTERS = {str(i): 40.0 for i in [32, *range(97, 123)]}  # token id = byte: " ", "a".."z"
VARIED = {"logit_bias": LETTERS, "frequency_penalty": 2.0}  # greedy, but a letter used is less likely next time


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """The node's base URL: on 127.0.0.1, or on a unix socket where this host has no TCP (``node_sockets``)."""
    model = load_model("tiny")
    engine = ColocatedEngine(model, num_pages=96, page_size=4)
    sockets = node_sockets(tmp_path_factory.mktemp("node"), "node")
    with AppServer(create_app(engine, model.tokenizer), **sockets) as server:
        yield unix_http.http_url(server.url)
    engine.close()


def chunks(url: str, path: str, body: dict) -> list[str]:
    """The SSE data lines of one stream, as a migrating router receives them (progress asked for)."""
    with unix_http.client(timeout=60) as client, client.stream("POST", url + path, json=body,
                                                           headers={PROGRESS_HEADER: "1"}) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line.startswith("data:")]


def client_view(lines: list[str], path: str) -> tuple[str, int, list[dict]]:
    """What a client makes of relayed lines: the text, how many role chunks, the usage chunks (/generate: the
    completion tokens each chunk counts)."""
    text, roles, usage, ids = "", 0, [], []
    for line in lines:
        if line == "data: [DONE]":
            continue
        doc = json.loads(line[5:])
        assert "error" not in doc and "fsm_pd_progress" not in doc, doc
        if doc.get("usage"):  # how much of a resumed prompt the prefix cache held is not the stream's business
            usage.append({k: v for k, v in doc["usage"].items() if k != "prompt_tokens_details"})
        if path == "/generate":  # cumulative: each chunk extends the one before
            assert doc["text"].startswith(text) and doc["output_ids"][:len(ids)] == ids, (text, ids, doc)
            text, ids = doc["text"], doc["output_ids"]
            usage.append(doc["meta_info"]["completion_tokens"])
            continue
        for choice in doc.get("choices", []):
            if path == "/v1/completions":
                text += choice["text"]
            else:
                roles += "role" in choice["delta"]
                text += choice["delta"].get("content") or ""
    return text, roles, usage


def cut_and_resume(url: str, path: str, body: dict, cut: int) -> list[str]:
    """The client's lines of a stream whose node failed after ``cut`` chunks and which a new node resumed."""
    progress = Progress()
    sent = [progress.relay(line) for line in chunks(url, path, body)[:cut]]
    assert not progress.finished
    return sent + [progress.relay(line) for line in chunks(url, path, progress.continued(body))]


CASES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": TOKENS,
                                      "temperature": 0, **VARIED, "stream": True,
                                      "stream_options": {"include_usage": True}}),
    "completions": ("/v1/completions", {"prompt": "once upon", "max_tokens": TOKENS, "temperature": 0,
                                        **VARIED, "stream": True, "stream_options": {"include_usage": True}}),
    "generate": ("/generate", {"text": "once upon", "stream": True,
                               "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, **VARIED}}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_stream_resumed_after_any_chunk_equals_the_undisturbed_one(url, case):
    path, body = CASES[case]
    whole = chunks(url, path, body)
    expected = client_view([Progress().relay(line) for line in whole], path)
    assert len(set(expected[0])) > 3, "one letter over and over: the test would prove little"
    content = [i for i, line in enumerate(whole) if "fsm_pd_progress" in line]
    assert len(content) >= 3, whole
    # cut after no line, after the chat's role chunk, after each content chunk; the last one finishes the stream
    for cut in range(content[-1]):
        got = client_view(cut_and_resume(url, path, body, cut), path)
        assert got == expected, (cut, got, expected)


def test_a_stop_string_across_the_cut_still_stops(url):
    path, body = CASES["completions"]
    text = client_view([Progress().relay(line) for line in chunks(url, path, body)], path)[0]
    stop = text[3:6]  # characters 3-5: any cut after the first content chunk can fall inside or before them
    stopped = {**body, "stop": [stop]}
    whole = chunks(url, path, stopped)
    expected = client_view([Progress().relay(line) for line in whole], path)
    assert expected[0] == text[:text.index(stop)]
    for cut in [i for i, line in enumerate(whole) if "fsm_pd_progress" in line][:-1]:
        assert client_view(cut_and_resume(url, path, stopped, cut + 1), path) == expected, cut
    resumed = chunks(url, path, {**stopped, "fsm_pd_resume": {"output_ids": [], "seed": None}})
    assert client_view([Progress().relay(line) for line in resumed], path) == expected  # a plain rerun
    # Cut where the old node held back the stop string's first character (a chunk's ids can end so when a token
    # brings certain text and a possible stop start at once): the client has text[:3], the new node must find the
    # stop across the cut, and send nothing more.
    held = {**stopped, "fsm_pd_resume": {"output_ids": [ord(c) for c in text[:4]], "seed": None}}
    rest = client_view([Progress().relay(line) for line in chunks(url, path, held)], path)
    assert (text[:3] + rest[0], rest[1:]) == (expected[0], expected[1:])  # nothing generated yet: a plain rerun


def test_a_resume_with_nothing_left_or_for_several_choices_is_a_400(url):
    path, body = CASES["completions"]
    r = unix_http.request("POST", url + path, json={**body, "max_tokens": 2, "fsm_pd_resume": {"output_ids": [65, 66]}},
                          timeout=30)
    assert r.status_code == 400 and "nothing is left" in r.json()["error"]["message"]
    r = unix_http.request("POST", url + path, json={**body, "n": 2, "fsm_pd_resume": {"output_ids": [65]}}, timeout=30)
    assert r.status_code == 400 and "n = 1" in r.json()["error"]["message"]
    r = unix_http.request("POST", url + path, json={**body, "fsm_pd_resume": {"output_ids": [-1]}}, timeout=30)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
