"""`fsm-pd launch` starts a whole local PD cluster, serves a request through it, and stops all of it on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
from processes import dies_with_parent

from fsm_pd.cli.launch import free_port
from fsm_pd.store import read_journal, replay


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def started(args: list[str], **popen) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """``fsm-pd launch ARGS``, the lines it prints and the thread that reads them, once it says it is serving. It
    gets SIGTERM when this process ends (``dies_with_parent``), and then stops the nodes it started, as on a test's
    own SIGTERM: SIGKILL would leave them running, each in a process group of its own."""
    proc = subprocess.Popen([sys.executable, "-m", "fsm_pd.cli", "launch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=dies_with_parent(signal.SIGTERM), **popen)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.time() + 300
    while not any("fsm-pd is serving" in line for line in lines):
        if proc.poll() is not None or time.time() > deadline:
            proc.terminate()  # launch stops the nodes it started so far (SIGKILL would leave them running)
            proc.wait(timeout=60)
            raise AssertionError("launch did not say it is serving:\n" + "".join(lines))
        time.sleep(0.3)
    return proc, lines, reader


def test_launch_serves_through_the_router_and_stops_everything(tmp_path):
    port = free_port()
    journals = tmp_path / "cluster"
    proc, lines, reader = started(["--port", str(port), "--journal-dir", str(journals)])
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    # the router's default policy (auto): a short prompt is served whole on the decode node, one over 256 tokens
    # goes through the prefill node
    short, long = {"text": "Hello"}, {"input_ids": [20 + i % 230 for i in range(300)]}
    try:
        for prompt, path in ((short, "local"), (long, "pd")):
            answer = httpx.post(f"http://127.0.0.1:{port}/generate", json={**prompt, "sampling_params": sampling},
                                timeout=120).json()
            assert len(answer["output_ids"]) == 8 and answer["meta_info"]["finish_reason"]["type"] == "length"
            assert answer["meta_info"]["pd_route"]["path"] == path, answer["meta_info"]
    finally:
        proc.send_signal(signal.SIGTERM)  # the launcher we started stops the processes it started
        proc.wait(timeout=60)
        reader.join(10)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert f"http://127.0.0.1:{port}" in out
    assert "What is the capital of France? -> " in out and "after the command" in out  # launch's warm-up request
    assert "only where that pays" in out  # launch says what the default policy does
    assert not listening(port)
    result = replay(read_journal(journals / "prefill-0.db") + read_journal(journals / "decode-0.db"))
    # the warm-up question and "Hello", each a record of the decode node's own; the long prompt's two sides
    assert result.consistent and {r.final for r in result.rooms} == {"Success"}
    assert sorted(r.role for r in result.rooms) == ["decode", "local", "local", "prefill"]


def test_launch_keeps_serving_while_a_node_of_each_role_is_alive(tmp_path):
    """Over unix sockets (``--uds``; test_launch_serves_through_the_router_and_stops_everything runs TCP): the killed
    node's sockets stay behind until launch, stopping, finds nobody listening on them."""
    sockets = tmp_path / "s"
    proc, lines, reader = started(["--prefill", "2", "--decode", "1", "--model", "tiny", "--no-warmup", "--uds",
                                   str(sockets), "--journal-dir", str(tmp_path / "cluster"),
                                   "--router-arg=--pd-policy=always"])  # every request through a prefill node
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    router = httpx.Client(transport=httpx.HTTPTransport(uds=str(sockets / "router.sock")), timeout=120)
    try:
        url = "http://localhost"
        assert router.post(url + "/generate", json=body).status_code == 200
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sockets / "decode-0.sock"))) as decode:
            # a node on unix sockets opens no TCP socket: a bootstrap server named over TCP is refused, and why
            over_tcp = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 5}
            refused = decode.post(url + "/generate", json=over_tcp, timeout=30)
            assert refused.status_code == 400 and "sglang-router cannot name unix sockets" in refused.text
        # a node launch started (a child of the launcher this test started), found by its node id
        (victim,) = [c for c in psutil.Process(proc.pid).children() if "prefill-1" in c.cmdline()]
        victim.kill()
        deadline = time.time() + 30
        while not any("still serving, on 1 prefill and 1 decode" in line for line in lines):
            assert proc.poll() is None and time.time() < deadline, "".join(lines)
            time.sleep(0.2)
        assert any("prefill-1 exited with -9" in line for line in lines)
        assert (sockets / "prefill-1.sock").is_socket()  # killed: left behind
        for _ in range(3):  # whichever prefill the router picks, the answer comes
            assert router.post(url + "/generate", json=body).status_code == 200
    finally:
        router.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(10)
    assert proc.returncode == 0, "".join(lines)
    assert list(sockets.iterdir()) == []


def test_one_ctrl_c_drains_every_node_and_a_running_stream_ends_whole(tmp_path):
    """A terminal's Ctrl-C is SIGINT to its whole foreground process group: launch runs here as a terminal's job (a
    session of its own), and the test signals the group as the terminal would. Each node must hear exactly one
    SIGTERM (launch's), and drain: the stream already running ends with all its tokens."""
    port, journals = free_port(), tmp_path / "cluster"
    proc, lines, reader = started(["--model", "tiny", "--no-warmup", "--port", str(port), "--journal-dir",
                                   str(journals)], start_new_session=True)
    body = {"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 300, "temperature": 0,
                                                                 "ignore_eos": True}}
    chunks = []
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/generate", json=body, timeout=120) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    chunks.append(json.loads(line.removeprefix("data:")))
                    if len(chunks) == 2:
                        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, mid-stream
    finally:
        if proc.poll() is None:
            proc.wait(timeout=120)
        reader.join(10)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "stopping: each node finishes its open requests" in out
    last = chunks[-1]
    assert len(last.get("output_ids", ())) == 300 and last["meta_info"]["finish_reason"]["type"] == "length", last
    for name in ("prefill-0", "decode-0"):
        log = (journals / f"{name}.log").read_text()
        assert "SIGTERM: draining this node" in log and "stopped cleanly" in log, log[-2000:]
        assert "again: exiting at once" not in log, log[-2000:]
    assert not listening(port)



def test_launch_as_one_pd_process_serves_hands_off_and_stops(tmp_path):
    """``--layout pd`` (the default where one process holds a host's accelerator, a TPU's: ``launch_layout.py``): one
    ``fsm-pd serve --role pd`` process in the router's place, on ``DIR/router.sock``, its engines' journals under the
    nodes' names; ``--pd-policy always`` sends every request through a handoff."""
    sockets, journals = tmp_path / "s", tmp_path / "cluster"
    proc, lines, reader = started(["--layout", "pd", "--model", "tiny", "--pd-policy", "always", "--uds",
                                   str(sockets), "--journal-dir", str(journals)])
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sockets / "router.sock")))
    try:
        answer = client.post("http://localhost/generate", timeout=120, json={
            "input_ids": [20 + i % 230 for i in range(40)],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
        assert len(answer["output_ids"]) == 6 and answer["meta_info"]["pd_route"]["path"] == "pd", answer
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(10)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "one process, a prefill and a decode engine" in out and "What is the capital of France? -> " in out
    assert f"curl --unix-socket {sockets / 'router.sock'} " in out  # how to reach it: where the router would be
    assert sorted(p.name for p in journals.glob("*.db")) == ["decode-0.db", "prefill-0.db"]
    assert not (sockets / "router.sock").exists()
    result = replay(read_journal(journals / "prefill-0.db") + read_journal(journals / "decode-0.db"))
    # the warm-up question and the request above: each a handoff, both sides Success
    assert result.consistent and [r.final for r in result.rooms] == ["Success"] * 4
    assert sorted(r.role for r in result.rooms) == ["decode", "decode", "prefill", "prefill"]
