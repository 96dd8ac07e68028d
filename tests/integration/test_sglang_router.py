"""The real sglang-router (the PyPI wheel's Rust binary, ``--pd-disaggregation``) in front of fsm-pd prefill and
decode servers (stub engines), everything on 127.0.0.1. Skipped when sglang-router is not installed (a real part:
``tests/real_parts.py``).

``HF_ENDPOINT`` points at a closed local port: after registering a worker the router tries to fetch a tokenizer
named by its ``model_path``, which must fail at once and locally (a warning only; routing works without it).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from processes import dies_with_parent
from real_parts import SGLANG_ROUTER
from stub_engine import DECODE_LOGPROB, PREFILL_LOGPROB, stub_server

from fsm_pd.cli.launch import free_port

pytestmark = SGLANG_ROUTER

BOOTSTRAP_PORT = 8998  # only passed along by the router; nothing needs to listen on it for stub engines
REQUEST_TIMEOUT_S = 5  # the router's total per-request timeout: how long it waits for a silent decode leg


@pytest.fixture(scope="module")
def smg(tmp_path_factory):
    """(router_url, prefill_engine, decode_engine)."""
    log_path = tmp_path_factory.mktemp("smg") / "router.log"
    with contextlib.ExitStack() as stack:
        p_url, prefill = stack.enter_context(stub_server("prefill", bootstrap_port=BOOTSTRAP_PORT))
        d_url, decode = stack.enter_context(stub_server("decode", bootstrap_port=BOOTSTRAP_PORT))
        port = free_port()
        env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
        log_file = stack.enter_context(open(log_path, "w"))  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
             "--prefill", p_url, str(BOOTSTRAP_PORT), "--decode", d_url, "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--policy", "random",
             "--disable-retries", "--request-timeout-secs", str(REQUEST_TIMEOUT_S)],
            env=env, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=dies_with_parent())
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:  # ready once both workers passed the router's health probe
                with contextlib.suppress(httpx.HTTPError):
                    r = httpx.post(url + "/generate", json={"text": "warm", "sampling_params": {"max_new_tokens": 1}},
                                   timeout=5)
                    if r.status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"sglang-router did not start routing: {log_path.read_text()[-2000:]}")
                time.sleep(0.3)
            yield url, prefill, decode
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def sse_data(text: str) -> list:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", text
    return [json.loads(x) for x in lines[:-1]]


def test_generate_whole_reaches_both_with_the_same_room(smg):
    url, prefill, decode = smg
    r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}, timeout=20)
    assert r.status_code == 200 and r.json()["text"] == " he"
    p, d = prefill.submitted[-1], decode.submitted[-1]
    assert p.bootstrap == d.bootstrap and (p.bootstrap.host, p.bootstrap.port) == ("127.0.0.1", BOOTSTRAP_PORT)
    assert p.seed == d.seed


def test_generate_logprobs_merged_by_the_router(smg):
    url, _, _ = smg
    r = httpx.post(url + "/generate", json={"text": "hey", "return_logprob": True,
                                            "sampling_params": {"max_new_tokens": 2}}, timeout=20)
    meta = r.json()["meta_info"]
    assert [x[0] for x in meta["input_token_logprobs"]] == [None, PREFILL_LOGPROB, PREFILL_LOGPROB]
    assert [x[0] for x in meta["output_token_logprobs"]] == [DECODE_LOGPROB, DECODE_LOGPROB]


def test_generate_stream(smg):
    url, _, _ = smg
    r = httpx.post(url + "/generate", json={"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 3}},
                   timeout=20)
    assert r.status_code == 200
    assert [c["text"] for c in sse_data(r.text)] == [" ", " h", " he"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions(smg, stream):
    url, _, _ = smg
    r = httpx.post(url + "/v1/completions", json={"model": "stub-model", "prompt": "hi", "max_tokens": 3,
                                                  "stream": stream}, timeout=20)
    assert r.status_code == 200
    text = ("".join(c["choices"][0]["text"] for c in sse_data(r.text) if c["choices"]) if stream
            else r.json()["choices"][0]["text"])
    assert text == " he"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions(smg, stream):
    url, _, decode = smg
    r = httpx.post(url + "/v1/chat/completions", json={"model": "stub-model", "max_tokens": 3, "stream": stream,
                                                       "messages": [{"role": "user", "content": "hi"}]}, timeout=20)
    assert r.status_code == 200
    text = ("".join(c["choices"][0]["delta"].get("content") or "" for c in sse_data(r.text) if c["choices"])
            if stream else r.json()["choices"][0]["message"]["content"])
    assert text == " he"
    assert decode.submitted[-1].sampling.max_new_tokens == 3  # the router renames max_tokens; it still arrives


def test_models_come_from_server_info(smg):
    url, _, _ = smg
    assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == ["stub-model"]


def test_openai_client_through_the_router(smg):
    openai = pytest.importorskip("openai")
    url, _, _ = smg
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)
    chat = client.chat.completions.create(model="stub-model", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3)
    assert chat.choices[0].message.content == " he" and chat.usage.completion_tokens == 3
    stream = client.chat.completions.create(model="stub-model", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == " he"
    comp = client.completions.create(model="stub-model", prompt="hi", max_tokens=2)
    assert comp.choices[0].text == " h" and comp.choices[0].finish_reason == "length"


def test_prefill_failure_with_a_silent_decode_ends_at_the_router_timeout_and_aborts_decode(smg):
    """Observed with sglang-router 0.3.2: when the prefill answers 500 and the decode leg stays silent (a decode
    waiting for KV that will not come), the router keeps waiting for the decode until --request-timeout-secs, then
    answers 502 ``decode_server_error`` and drops the decode connection, which fsm-pd's API turns into an abort.
    (fsm-pd's own router cancels the decode at once and returns the prefill's error: test_router.py.)"""
    url, prefill, decode = smg
    prefill.fail_after, decode.hang = 0, True
    try:
        before = len(decode.submitted)
        started = time.monotonic()
        r = httpx.post(url + "/generate", json={"text": "a"}, timeout=REQUEST_TIMEOUT_S + 15)
        assert 500 <= r.status_code < 600
        assert time.monotonic() - started < REQUEST_TIMEOUT_S + 10
        assert decode.wait_submitted(before + 1)
        rid = decode.submitted[before].rid
        deadline = time.monotonic() + 5  # the router dropped the decode connection; the API aborts on disconnect
        while rid not in decode.aborted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rid in decode.aborted
    finally:
        prefill.fail_after, decode.hang = None, False


def test_bad_request_is_4xx_through_the_router(smg):
    url, _, _ = smg
    r = httpx.post(url + "/v1/chat/completions", json={"model": "stub-model", "max_tokens": -1,
                                                       "messages": [{"role": "user", "content": "hi"}]}, timeout=20)
    assert 400 <= r.status_code < 500, r.text
