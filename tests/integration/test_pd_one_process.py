"""``fsm-pd serve --role pd``: a prefill engine, a decode engine and a node's app over both (or, ``--pd-front router``,
the built-in router) in one real process, on unix sockets only (as on a TPU host, where one process holds the chip
and no TCP socket opens). By default (backend ``pool``) the two engines share one KV pool and a handoff moves page
ownership: ``/metrics`` counts each transfer with 0 bytes and the prompt's pages adopted. With ``--transfer-backend
device`` each engine has its own pool and the KV is handed over as arrays on the device: ``/metrics`` counts one
transfer of the KV's bytes, checksum verified, per request. Either way the greedy answers must equal a colocated
node's for the same prompts, and every handoff must be a room that ended Success on both sides of its journals and
replays consistently.

The issue asks for 32 requests of 8 to 900 tokens; the suite sends ``FSM_PD_ONE_PROCESS_REQUESTS`` of them (default
8, to stay within the suite's time), and the same test runs 32 by hand with that variable set.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from processes import dies_with_parent
from prometheus_client.parser import text_string_to_metric_families
from xla_flags import with_host_devices

from fsm_pd.kernels import page_bucket
from fsm_pd.model.loader import load_model
from fsm_pd.net import unix_http
from fsm_pd.net.unix_sockets import unix_address
from fsm_pd.store import read_journal, replay

REQUESTS = int(os.environ.get("FSM_PD_ONE_PROCESS_REQUESTS", "8"))
VOCAB = 272  # the tiny model's
NEW_TOKENS = 6
PAGE_SIZE = 16  # the nodes' default


def prompts(n: int) -> list[list[int]]:
    """``n`` prompts of 8 to 900 tokens, both ends included, varied so that their answers differ."""
    rng = random.Random(43)
    lengths = [8, 900, *(rng.randint(9, 899) for _ in range(max(0, n - 2)))][:n]
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for length in lengths]


def start(tmp: Path, name: str, *argv: str, env: dict | None = None) -> tuple[str, subprocess.Popen]:
    sock = tmp / f"{name}.sock"
    env = {**os.environ, "FSM_PD_MODEL": "tiny", **(env or {})}
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - the child writes to it
    proc = subprocess.Popen([sys.executable, "-m", "fsm_pd.cli", "serve", *argv, "--uds", str(sock)],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=tmp,
                            preexec_fn=dies_with_parent())
    return unix_http.http_url(unix_address(str(sock))), proc


def wait_healthy(client, url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited with {proc.returncode}: {log.read_text()[-3000:]}"
        try:
            if client.get(url + "/health", timeout=2).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy within {timeout_s}s")


def greedy(client, url: str, ids: list[int]) -> tuple[list[int], str]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    answer = client.post(url + "/generate", json=body, timeout=180)
    assert answer.status_code == 200, answer.text
    return answer.json()["output_ids"], answer.headers.get("x-fsm-pd-route", "")


def samples(text: str, family: str) -> dict[tuple, float]:
    found = {}
    for metric in text_string_to_metric_families(text):
        for sample in metric.samples:
            if sample.name == family:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def settled(client, url: str, timeout_s: float = 10) -> str:
    """The process's /metrics once neither engine holds a transfer entry: each was released when its room ended (a
    hold that lingers would be a leak, ended only by its expiry a minute later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = client.get(url + "/metrics").text
        held = samples(text, "fsm_pd_open_transfer_entries")
        assert len(held) == 2, held
        if not any(held.values()) or time.monotonic() > deadline:
            assert not any(held.values()), f"transfer entries still held: {held}"
            return text
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# (backend, its flags, the process's environment): one pool; a pool each on one device; a device each
SETUPS = {"pool": ("pool", [], {}), "device": ("device", ["--transfer-backend", "device"], {}),
          # the built-in router in front instead of a node's app over both engines (cli/pd_pair.py, the default)
          "pool-router": ("pool", ["--pd-front", "router"], {}),
          "two-devices": ("device", ["--prefill-devices", "1", "--decode-devices", "1"],
                          {"XLA_FLAGS": with_host_devices(2)})}


@pytest.fixture(scope="module")
def colocated_answers(tmp_path_factory) -> list[list[int]]:
    """A colocated node's greedy answers to ``prompts(REQUESTS)``, what every setup must give: asked once for the
    module (they depend on no setup of the PD process)."""
    tmp = tmp_path_factory.mktemp("colocated")
    url, proc = start(tmp, "colocated", "--role", "colocated")
    try:
        with unix_http.client(timeout=180) as client, ThreadPoolExecutor(4) as pool:
            wait_healthy(client, url, proc, tmp / "colocated.log")
            return list(pool.map(lambda ids: greedy(client, url, ids)[0], prompts(REQUESTS)))
    finally:
        stop(proc)


@pytest.mark.slow
@pytest.mark.parametrize("setup", list(SETUPS))
def test_pd_in_one_process_answers_as_colocated(tmp_path, setup, colocated_answers):
    backend, flags, env = SETUPS[setup]
    journals = tmp_path / "journals"
    pd_url, pd = start(tmp_path, "pd", "--role", "pd", "--pd-policy", "always", "--journal-dir", str(journals),
                       "--prefill-pages", "300", "--decode-pages", "400", *flags, env=env)
    asked, want = prompts(REQUESTS), colocated_answers
    try:
        with unix_http.client(timeout=180) as client:
            wait_healthy(client, pd_url, pd, tmp_path / "pd.log")
            with ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda ids: greedy(client, pd_url, ids), asked))
            metrics = settled(client, pd_url)
            info = client.get(pd_url + "/server_info").json()
            if "--pd-front" not in flags:  # the pair is the app's engine: its routes counted there
                assert info["internal_states"][0]["routed"] == {"pd": REQUESTS, "local": 0}
            else:  # its one decode engine has no other to move a stream to: the router relays the engine's bytes
                assert info["migrate"] is False
    finally:
        assert stop(pd) == 0, (tmp_path / "pd.log").read_text()[-3000:]

    assert [route for _, route in got] == ["pd"] * REQUESTS, "--pd-policy always sends every request through prefill"
    assert [ids for ids, _ in got] == want
    assert len({tuple(ids) for ids in want}) >= min(REQUESTS, 4), "varied prompts, varied answers"

    rows = [row for side in ("prefill-0", "decode-0") for row in read_journal(journals / f"{side}.db")]
    result = replay(rows)
    assert result.consistent, [d.describe() for d in result.divergences]
    assert len(result.rooms) == 2 * REQUESTS and {r.final for r in result.rooms} == {"Success"}

    assert samples(metrics, "fsm_pd_router_routed_total")[(("path", "pd"),)] == REQUESTS  # either front counts
    used = samples(metrics, "fsm_pd_transfer_backend")
    assert used == {(("backend", backend), ("node", side), ("role", side.split("-")[0])): 1.0
                    for side in ("prefill-0", "decode-0")}
    ended = samples(metrics, "fsm_pd_transfers_ended_total")
    decode = (("node", "decode-0"), ("role", "decode"))
    assert ended[(("node", "decode-0"), ("outcome", "success"), ("reason", "none"), ("role", "decode"))] == REQUESTS
    assert sum(v for k, v in ended.items() if ("outcome", "failed") in k) == 0
    moved = samples(metrics, "fsm_pd_transfer_bytes_sum")[decode]
    adopted = samples(metrics, "fsm_pd_pages_adopted_total")[decode]
    prompt_pages = sum(-(-len(ids) // PAGE_SIZE) for ids in asked)
    assert samples(metrics, "fsm_pd_transfer_bytes_count")[decode] == REQUESTS
    checksums = samples(metrics, "fsm_pd_kv_checksums_total")
    if backend == "pool":  # ownership moved: every prompt page adopted, not a byte copied, nothing to checksum
        assert (moved, adopted) == (0, prompt_pages)
        assert checksums[(("node", "decode-0"), ("outcome", "off"), ("role", "decode"))] == REQUESTS
    else:  # the KV's bytes: every prompt page's, in staging arrays of at most whole page buckets
        page_bytes = load_model("tiny").make_kv_layout(2, PAGE_SIZE).page_bytes()
        bucketed = sum(page_bucket(-(-len(ids) // PAGE_SIZE)) for ids in asked) * page_bytes
        assert adopted == 0 and prompt_pages * page_bytes <= moved <= bucketed, (moved, prompt_pages, page_bytes)
        assert checksums[(("node", "decode-0"), ("outcome", "verified"), ("role", "decode"))] == REQUESTS
    if setup == "two-devices":  # each role's pool on its own device
        assert "prefill 300 pages on cpu:0, decode 400 pages on cpu:1" in (tmp_path / "pd.log").read_text()

