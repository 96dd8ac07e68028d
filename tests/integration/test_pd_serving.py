"""Real servers, real clients: `fsm-pd serve` prefill, decode and colocated processes with the tiny model, behind the
built-in router and the real sglang-router, on 127.0.0.1.

PD answers must equal colocated answers token for token under greedy sampling (20 varied prompts at concurrency 8,
for each transfer backend), and the real sglang-router and the openai client must work in front of fsm-pd.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from processes import PAGE_SIZE, Cluster
from real_parts import SGLANG_ROUTER

from fsm_pd.store import read_journal, replay

# one xdist worker runs every module on the shared PD cluster (conftest.pd_urls), so that a run starts it once
pytestmark = pytest.mark.xdist_group("shared-pd")

# shorter than a page, about one page, just over, and many pages (the tiny model's tokenizer is byte-level)
PROMPTS = ["Hi", "a" * (PAGE_SIZE - 1), "b" * PAGE_SIZE, "c" * (PAGE_SIZE + 1), "The quick brown fox " * 6,
           "x" * (PAGE_SIZE * 7), "PD disaggregation", "0123456789" * 9, "?", "Hello, world!",
           "z" * (PAGE_SIZE * 2), "lorem ipsum dolor sit amet " * 4, "y" * (PAGE_SIZE * 3 - 1), "json: {}",
           "tab\tand\nnewline", "w" * 33, "v" * 64, "unicode é ü", "end.", "k" * 200]


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def colocated(pd_urls):
    """The colocated node every PD setup is compared with (the test process's shared cluster's, ``conftest.pd_urls``:
    a greedy answer depends on nothing it served before): its URL and its greedy answers to ``PROMPTS``, asked once
    (they depend on no transfer backend)."""
    url = pd_urls["colocated"]
    return url, all_greedy(url)


def greedy(url: str, prompt: str) -> list[int]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    answer = httpx.post(url + "/generate", json=body, timeout=180)
    assert answer.status_code == 200, answer.text
    return answer.json()["output_ids"]


def all_greedy(url: str) -> list[list[int]]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: greedy(url, p), PROMPTS))


def journaled_rooms(where: Path) -> list:
    """The replayed sides (``RoomReport``) of every room in the journals under ``where``."""
    return replay([row for j in sorted(where.glob("*.db")) for row in read_journal(j)]).rooms


@pytest.mark.parametrize("backend", ["zmq", "jax", "tcp"])
def test_pd_answers_equal_colocated_answers(request, colocated, backend):
    if backend == "zmq":
        # the shared cluster's pair (``conftest.pd_urls``) is a zmq pair behind the built-in router, started as
        # ``cluster.pd`` and ``cluster.router`` start one below: its rooms are the ones its journals gain here
        shared = request.getfixturevalue("_shared_pd")
        router, where = shared.get()["router"], shared.cluster.tmp
    else:
        cluster = request.getfixturevalue("cluster")
        p, boot, d = cluster.pd(backend)
        router, where = cluster.router(p, boot, d), cluster.tmp
    before = {(r.node, r.role, r.room) for r in journaled_rooms(where)}
    _, want = colocated
    got = all_greedy(router)
    assert got == want
    assert all(len(ids) == 12 for ids in got)
    assert len({tuple(ids) for ids in want}) >= 10, "varied prompts must give varied answers, or equality proves little"
    rooms = [r for r in journaled_rooms(where) if (r.node, r.role, r.room) not in before]
    assert [r.divergence for r in rooms if r.divergence is not None] == [] and len(rooms) == 2 * len(PROMPTS)
    assert {r.final for r in rooms} == {"Success"}


@SGLANG_ROUTER
def test_real_sglang_router_and_openai_client(pd_urls, colocated):
    openai = pytest.importorskip("openai")
    colocated, _ = colocated
    router = pd_urls["sglang-router"]  # in front of the shared cluster's zmq pair (``processes.pd_beside_colocated``)
    prompt = "The quick brown fox"
    assert greedy(router, prompt) == greedy(colocated, prompt)

    streamed = []
    body = {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                  "ignore_eos": True}}
    with httpx.stream("POST", router + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        streamed = [line for line in r.iter_lines() if line.startswith("data:")]
    assert streamed[-1] == "data: [DONE]" and len(streamed) >= 3

    for base in (router, colocated):
        client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0)
        completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert completion.usage.completion_tokens >= 1 and completion.choices[0].finish_reason in ("length", "stop")
        pieces = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                                stream=True))
        assert "".join(p.choices[0].text for p in pieces if p.choices) == completion.choices[0].text
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.role == "assistant"
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=8, temperature=0, stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
