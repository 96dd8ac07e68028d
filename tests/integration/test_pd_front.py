"""``fsm-pd serve --role pd`` answers for its health, start-up and drain like a node (``cli/pd_front.py``), as a real
process on a unix socket:

- a chat sent the moment the socket first accepts, while both engines still prepare their programs, waits for them
  and is answered (it was lost after 60 s on a TPU host: the process said 200 while it compiled);
- ``/health`` says 503 ``starting`` before ready, and ``/health`` and ``/livez`` turn 503 within 5 s once a fault
  knob crashes one role (the process lives on, and says why);
- SIGTERM drains: new requests get 503 ``draining``, the open one finishes, and the process exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from processes import dies_with_parent
from xla_flags import for_cold_starts

from fsm_pd.net import unix_http
from fsm_pd.net.unix_sockets import unix_address

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "temperature": 0}


def start(tmp: Path, *argv: str, env: dict | None = None) -> tuple[str, Path, subprocess.Popen]:
    sock = tmp / "pd.sock"
    log = open(tmp / "pd.log", "w")  # noqa: SIM115 - the child writes to it
    proc = subprocess.Popen([sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "pd", "--uds", str(sock),
                             "--journal-dir", str(tmp / "journals"), "--prefill-pages", "64", "--decode-pages", "128",
                             *argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp,
                            env={**os.environ, "FSM_PD_MODEL": "tiny", **(env or {})}, preexec_fn=dies_with_parent())
    return unix_http.http_url(unix_address(str(sock))), sock, proc


def first_accept(client, url: str, sock: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Return as soon as the socket takes a connection (any answer)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        if sock.exists():
            try:
                client.get(url + "/livez", timeout=5)
                return
            except Exception:  # noqa: BLE001 - bound, not accepting yet
                pass
        time.sleep(0.01)
    raise TimeoutError("the socket never accepted")


def until_ready(client, url: str, sock: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Return once the process accepts and ``/health`` says 200."""
    first_accept(client, url, sock, proc)
    deadline = time.monotonic() + timeout_s
    while client.get(url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.1)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@pytest.mark.slow
def test_a_chat_sent_at_the_first_accept_is_answered_and_sigterm_drains(tmp_path):
    # the warm-up on (the suite skips it) and no compile cache: the engines compile every program before they are
    # ready, so the first accept comes well before that; XLA's cheapest compiles (on the CPU), as the process compiles
    # far more than it runs
    url, sock, proc = start(tmp_path, "--pd-policy", "always", "--compile-cache", "off",
                            env={"FSM_PD_SKIP_SERVER_WARMUP": "0", "XLA_FLAGS": for_cold_starts()})
    log = tmp_path / "pd.log"
    try:
        with unix_http.client(timeout=180) as client:
            first_accept(client, url, sock, proc)
            health = client.get(url + "/health")
            started = client.get(url + "/startupz")
            answer = client.post(url + "/v1/chat/completions", json=CHAT)  # sent at once, while it may still start
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] >= 1
            # caught while starting: it said so, with each engine's progress, and the chat waited
            assert health.status_code == 503 and health.json()["status"] == "starting", health.text
            assert set(health.json()["engines"]) == {"prefill", "decode"}
            assert started.status_code == 503
            assert client.get(url + "/health").status_code == 200
            assert client.get(url + "/startupz").status_code == 200

            # a long answer in flight, then SIGTERM: it finishes, a new request is refused, the process exits 0
            long_chat = {**CHAT, "max_tokens": 200, "ignore_eos": True}
            done: dict = {}
            worker = threading.Thread(target=lambda: done.update(
                r=client.post(url + "/v1/chat/completions", json=long_chat)))
            worker.start()
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            refused = None
            while time.monotonic() < deadline and refused is None:
                try:
                    got = client.post(url + "/v1/chat/completions", json=CHAT, timeout=5)
                except Exception:  # noqa: BLE001 - the server may already have stopped
                    break
                if got.status_code == 503:
                    refused = got
                time.sleep(0.05)
            worker.join(timeout=60)
            assert done["r"].status_code == 200, done["r"].text
            assert done["r"].json()["usage"]["completion_tokens"] == 200
            assert refused is None or "draining" in refused.text
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()[-3000:]
    assert "drain" in log.read_text()


@pytest.mark.slow
def test_a_crashed_role_turns_health_and_livez_503_within_5s(tmp_path):
    url, sock, proc = start(tmp_path, "--pd-policy", "always", env={"FSM_PD_FAULT_CRASH_AT": "before_scatter"})
    try:
        with unix_http.client(timeout=60) as client:
            until_ready(client, url, sock, proc)
            answer = client.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
            crashed_at = time.monotonic()
            assert answer.status_code >= 500, answer.text  # the decode role died under it
            while True:
                health, livez = client.get(url + "/health"), client.get(url + "/livez")
                if health.status_code != 200 and livez.status_code != 200:
                    break
                assert time.monotonic() - crashed_at < 5, (health.text, livez.text)
                time.sleep(0.1)
            assert "decode" in livez.json()["reason"] and "fault injection" in livez.json()["reason"]
            assert proc.poll() is None, "the process lives on and says why"
            refused = client.post(url + "/v1/chat/completions", json=CHAT, timeout=30)
            assert refused.status_code == 503, refused.text
    finally:
        stop(proc)
