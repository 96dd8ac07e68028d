"""``fsm-pd launch --uds`` where there is no network: the whole cluster runs in a fresh network namespace
(``unshare --net``), whose loopback is down, so no TCP connection can be made there, and serves over unix sockets
alone. Unix sockets are files, so this test reaches the router's socket from outside the namespace.

Eight chats go through ``DIR/router.sock`` (the router's default ``--pd-policy auto``: the long prompts through the
prefill node, the short ones whole on the decode node); the journals show every handoff's room at Success on both
sides; no process of the cluster holds a TCP or UDP socket (the namespace's ``/proc/net`` tables are empty, and every
socket each process holds is a unix or netlink one); a clean stop removes every socket file.

Needs root for ``unshare --net`` (CI runs as root). Where it is not permitted the test is skipped with the reason and
counted as a skipped real part (``tests/real_parts.py``): CI, which requires the real parts, then fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from processes import dies_with_parent

from fsm_pd.store import read_journal, replay

pytestmark = pytest.mark.real_part("netns")

LONG = "The quick brown fox jumps over the lazy dog. " * 27  # ~1200 characters: over 256 tokens as the router guesses
SHORT = "Hi"


def why_no_netns() -> str | None:
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    done = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"unshare --net is not permitted here (needs root): {done.stderr.strip() or done.returncode}"
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``(launch process, its output lines, socket dir, journal dir)``, once ``fsm-pd launch --uds`` serves inside
    its own network namespace."""
    why = why_no_netns()
    if why is not None:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("uds-netns")
    sockets, journals = tmp / "s", tmp / "j"
    # unshare execs the command: the PID is launch's own
    proc = subprocess.Popen(["unshare", "--net", sys.executable, "-m", "fsm_pd.cli", "launch", "--uds", str(sockets),
                             "--journal-dir", str(journals)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=dies_with_parent(signal.SIGTERM))  # launch then stops its nodes
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.time() + 240
    while not any("fsm-pd is serving" in line for line in lines):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail("launch --uds did not say it is serving:\n" + "".join(lines))
        time.sleep(0.3)
    yield proc, lines, sockets, journals
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_the_cluster_is_in_a_namespace_without_a_network(cluster):
    proc, lines, sockets, _ = cluster
    assert os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
    probe = "import socket; socket.create_connection(('127.0.0.1', 9), timeout=2)"
    done = subprocess.run(["nsenter", f"--net=/proc/{proc.pid}/ns/net", sys.executable, "-c", probe],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "unreachable" in done.stderr, done.stderr  # loopback is down in there
    out = "".join(lines)
    router = sockets / "router.sock"
    assert f"unix:{router}" in out and f"curl --unix-socket {router} http://localhost/v1/chat/completions" in out


def test_chats_through_the_router_socket_long_ones_through_prefill(cluster):
    _, _, sockets, _ = cluster
    transport = httpx.HTTPTransport(uds=str(sockets / "router.sock"))  # what any HTTP client can do
    with httpx.Client(transport=transport, base_url="http://localhost", timeout=120) as client:
        for i in range(8):
            prompt = f"{i}: {LONG}" if i % 2 else f"{SHORT} {i}"
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0}
            answer = client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] >= 1
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sockets / "decode-0.sock"))) as decode:
        metrics = decode.get("http://localhost/metrics").text  # a node's metrics, on its own socket
        assert "fsm_pd_kv_pages_free" in metrics, metrics[:500]


def test_no_process_of_the_cluster_holds_a_tcp_socket(cluster):
    proc, _, _, _ = cluster
    launch = psutil.Process(proc.pid)
    processes = [launch, *launch.children(recursive=True)]
    assert len(processes) >= 4  # launch, prefill, decode, router
    tables = {name: Path(f"/proc/{proc.pid}/net/{name}").read_text().splitlines()
              for name in ("tcp", "tcp6", "udp", "udp6", "unix", "netlink")}
    for name in ("tcp", "tcp6", "udp", "udp6"):
        assert tables[name][1:] == [], f"the namespace has {name} sockets: {tables[name][1:]}"
    allowed = {line.split()[6] for line in tables["unix"][1:]} | {line.split()[9] for line in tables["netlink"][1:]}
    for p in processes:
        for fd in os.listdir(f"/proc/{p.pid}/fd"):
            try:
                target = os.readlink(f"/proc/{p.pid}/fd/{fd}")
            except FileNotFoundError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inode = target[len("socket:["):-1]
                assert inode in allowed, f"{' '.join(p.cmdline()[3:7])} holds socket {inode}, neither unix nor netlink"


def test_a_clean_stop_removes_every_socket_and_the_journals_hold_the_handoffs(cluster):
    proc, lines, sockets, journals = cluster
    stop(proc)
    assert proc.returncode == 0, "".join(lines)
    assert list(sockets.iterdir()) == []
    result = replay(read_journal(journals / "prefill-0.db") + read_journal(journals / "decode-0.db"))
    assert result.consistent and {r.final for r in result.rooms} == {"Success"}
    sides = {role: sorted(r.room for r in result.rooms if r.role == role) for role in ("prefill", "decode", "local")}
    assert len(sides["prefill"]) == 4 and sides["prefill"] == sides["decode"]  # the long chats, handed off
    assert len(sides["local"]) == 5  # the short chats and launch's warm-up question, served whole on decode
