"""Two real processes: a prefill engine in a child process, a decode engine here, the ``zmq`` data plane and a
real bootstrap server between them; greedy output must equal the colocated engine's, token for token."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from processes import dies_with_parent

from fsm_pd.model.loader import load_model
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.types import Bootstrap, GenerateRequest
from fsm_pd.transport import generate_secret, secret_env

PAGES, PAGE_SIZE = 96, 4
LENGTHS = [1, 3, 4, 5, 8, 13, 31, 64, 90, 120]
NEW_TOKENS = 10


class PrefillProcess:
    def __init__(self, secret: bytes):
        env = {**os.environ, **secret_env(secret), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        script = Path(__file__).with_name("serving_prefill_node.py")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(PAGES), str(PAGE_SIZE)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=dies_with_parent(),
        )
        self.hello = json.loads(self.proc.stdout.readline())
        self.answers: dict[str, dict] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            out = json.loads(line)
            self.answers[out["rid"]] = out

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        try:
            self.proc.stdin.write("\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001 - make sure it is gone either way
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def prefill_process():
    secret = generate_secret()
    proc = PrefillProcess(secret)
    yield proc, secret
    proc.stop()


def test_two_process_pd_matches_colocated(prefill_process, tmp_path):
    proc, secret = prefill_process
    model = load_model("tiny")
    text = "a paged kv cache moves from one process to another; " * 4
    prompts = [model.tokenizer.encode(text[i : i + n]) for i, n in enumerate(LENGTHS)]
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)

    colocated = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE)
    try:
        want = [
            [o.token_id for o in asyncio.run(generate(colocated, GenerateRequest(f"c{i}", x, params, seed=0)))]
            for i, x in enumerate(prompts)
        ]
    finally:
        colocated.close()

    decode = DecodeEngine(
        model, num_pages=PAGES, page_size=PAGE_SIZE, secret=secret, backend="zmq", journal=str(tmp_path / "d.db")
    )
    host, port = proc.hello["bootstrap_host"], proc.hello["bootstrap_port"]

    async def through_pd():
        gate = asyncio.Semaphore(8)

        async def one(i, x):
            async with gate:
                rid, room = f"r{i}", 5000 + i
                proc.send(rid=rid, input_ids=x, room=room, max_new_tokens=NEW_TOKENS)
                req = GenerateRequest(rid, x, params, seed=0, bootstrap=Bootstrap(host, port, room))
                return [o.token_id for o in await generate(decode, req)]

        return await asyncio.wait_for(asyncio.gather(*[one(i, x) for i, x in enumerate(prompts)]), 240)

    try:
        got = asyncio.run(through_pd())
        # the engine drops a request from its table just after streaming the last token, so the gauge may trail
        # the client by a moment; a request that is never dropped still fails this
        deadline = time.time() + 5
        while decode.info()["requests_live"] and time.time() < deadline:
            time.sleep(0.01)
        info = decode.info()
    finally:
        decode.close()
    assert got == want
    assert info["requests_live"] == 0
    # the prefill process answers each request once PULLED reaches it, which may trail D's last token a little
    deadline = time.time() + 10
    while time.time() < deadline and len(proc.answers) < len(prompts):
        time.sleep(0.05)
    assert {rid: out.get("token_id") for rid, out in proc.answers.items()} == {
        f"r{i}": tokens[0] for i, tokens in enumerate(want)
    }
