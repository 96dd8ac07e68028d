"""Real processes with their default warm-up: a PD pair prepares the programs that cover every request before
``/health`` answers (and compiles the rest in the background), so requests of every kind through the router compile
nothing on either node (``fsm_pd_compiles_total``), even while the background compile still runs."""

from __future__ import annotations

import re

import httpx
import pytest
from processes import Cluster, free_port
from xla_flags import for_cold_starts

from fsm_pd.kernels.kv_checksum import ALGORITHM_ENV
from fsm_pd.kernels.kv_hash import ALGORITHM as DEVICE_HASH

# The warm-up on, and XLA's cheapest compiles (-O0 on the CPU, ``xla_flags.for_cold_starts``): each node compiles its
# whole ready set and then answers six requests, so it compiles far more than it runs.
WARMUP = {"FSM_PD_SKIP_SERVER_WARMUP": "0", "XLA_FLAGS": for_cold_starts()}


def compiles(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {phase: float(value) for phase, value in
            re.findall(r'^fsm_pd_compiles_total\{phase="(\w+)"\} (\S+)$', text, flags=re.MULTILINE)}


@pytest.mark.parametrize("prefill_tp, decode_tp, checksum", [(1, 1, "crc32c"), (2, 2, DEVICE_HASH), (1, 2, "crc32c")])
def test_a_warmed_pd_pair_compiles_nothing_while_serving(tmp_path, prefill_tp, decode_tp, checksum):
    """With ``tp`` 2 the pools are split over 2 devices: the sharded forward passes and page kernels are warmed the
    same way. A handoff between different sizes cuts P's staging into pieces and joins them on D: on CPU devices on
    the host, so that no request waits for a program the warm-up could not know it needed (docs/tensor-parallel.md).
    The requests come right after ready, while the background compile still runs: they use what covers them. The
    2-2 pair checksums its handoffs with the device hash, as pools on an accelerator do: a program per page bucket,
    warmed too."""
    cluster = Cluster(tmp_path)
    cluster.env |= WARMUP | {ALGORITHM_ENV: checksum}
    # a small pool keeps the context's buckets (and so the warm-up) short; the rule is the same at any size
    pool = ("--num-pages", "48")
    try:
        boot = free_port()
        prefill, decode = cluster.serve_many(("prefill", "--bootstrap-port", str(boot), *pool, "--tp", str(prefill_tp)),
                                             ("decode", *pool, "--tp", str(decode_tp)))
        router = cluster.router(prefill, boot, decode)
        for url in (prefill, decode):
            assert compiles(url)["startup"] > 5 and compiles(url)["serving"] == 0
        lengths = [2, 30, 100, 300, 700]
        bodies = [{"input_ids": [(i * 13 + j) % 200 + 1 for j in range(n)], "stream": i % 2 == 0,
                   "return_logprob": i % 3 == 0, "top_logprobs_num": 2 if i == 3 else 0,
                   "sampling_params": {"max_new_tokens": 5 + i, "temperature": 0.7 if i % 2 else 0,
                                       "ignore_eos": True, "frequency_penalty": 0.3 if i == 2 else 0}}
                  for i, n in enumerate(lengths)]
        with httpx.Client(timeout=120) as client:
            for body in bodies:
                assert client.post(router + "/generate", json=body).status_code == 200
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert client.post(router + "/v1/chat/completions", json=chat).status_code == 200
        assert compiles(prefill)["serving"] == 0, "the prefill node compiled while serving (see its log)"
        assert compiles(decode)["serving"] == 0, "the decode node compiled while serving (see its log)"
    finally:
        cluster.stop()
