"""A 20 MB request body empties nothing: the built-in router, a colocated node and ``--role pd`` answer it 413 at once,
before reading or parsing it, while a stream beside it goes on token by token; the next request is served, and the
router has ejected no worker.

Issue 51 found one such body (no limit then, and the node parsed and tokenized it on its event loop) froze a colocated
node's stream for 30 s, and got both workers of a ``launch`` cluster ejected for a minute. A node's limit follows its
context (``net/body_limit.py``: 1 MiB plus 64 bytes a token), and the router takes the smallest its workers report.
The bounds below (413 within 1 s, no gap between a stream's tokens over 1 s) are the issue's, far above a healthy
node's (a few ms) and far below a frozen one's.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import sys
import threading
import time

import httpx
import pytest
from processes import Cluster, free_port, wait_health

# one xdist worker runs every module on the shared PD cluster (conftest.pd_urls), so that a run starts it once
pytestmark = pytest.mark.xdist_group("shared-pd")

TOTAL = 20_000_000
BOUND_S = 1.0
STREAMED = 400


@pytest.fixture(scope="module")
def targets(tmp_path_factory, pd_urls):
    """``{"router", "colocated", "pd"}`` -> base URL: the test process's shared PD pair behind the built-in router
    beside a colocated node (``conftest.pd_urls``: a refused body changes nothing there), and a ``--role pd`` process
    with its API on a TCP port."""
    cluster = Cluster(tmp_path_factory.mktemp("oversized"))
    try:
        port = free_port()
        pd = cluster.launch("pd", [sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "pd", "--port", str(port),
                                   "--page-size", "16", "--journal-dir", str(cluster.tmp / "pd-journals")])
        found = {**pd_urls, "pd": f"http://127.0.0.1:{port}"}
        wait_health(found["pd"], pd)
        yield found
    finally:
        cluster.stop()


def post_big(url: str, total: int, *, chunked: bool) -> int:
    """POST a /generate body of ``total`` bytes, a valid JSON document (one long text: what a node would parse and
    tokenize), as a client that does not wait would send it: on a raw socket, until the answer is readable (an HTTP
    library still writing often sees the server's reset instead of its early answer). The answer's status."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head, tail = b'{"text": "', b'"}'
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{framing}"
                     "\r\n\r\n".encode())
        sent, piece = 0, b"a" * 65536
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < total and not select.select([sock], [], [], 0)[0]:
                chunk = head + piece[len(head):] if sent == 0 else piece
                chunk = chunk[: total - sent]
                if sent + len(chunk) == total:
                    chunk = chunk[: -len(tail)] + tail
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                sent += len(chunk)
            if chunked and sent >= total:
                sock.sendall(b"0\r\n\r\n")
        answer = b""
        while b"\r\n" not in answer:
            data = sock.recv(4096)
            if not data:
                break
            answer += data
    return int(answer.split(b" ", 2)[1])


class Stream(threading.Thread):
    """A greedy /generate stream of ``STREAMED`` tokens; when each chunk came."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.arrivals, self.last, self.error = url, [], None, None
        self.started_streaming = threading.Event()

    def run(self) -> None:
        body = {"text": "Hello", "stream": True,
                "sampling_params": {"max_new_tokens": STREAMED, "temperature": 0, "ignore_eos": True}}
        try:
            with httpx.stream("POST", self.url + "/generate", json=body, timeout=120) as answer:
                for line in answer.iter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        self.arrivals.append(time.monotonic())
                        self.last = json.loads(line.removeprefix("data:"))
                        if len(self.arrivals) == 3:
                            self.started_streaming.set()
        except Exception as exc:  # noqa: BLE001 - the test reports it
            self.error = exc
        finally:
            self.started_streaming.set()

    def longest_gap(self) -> float:
        return max(b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False))


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("name", ["router", "colocated", "pd"])
def test_a_20_mb_body_is_413_at_once_and_the_stream_beside_it_goes_on(targets, name, chunked):
    url = targets[name]
    stream = Stream(url)
    stream.start()
    assert stream.started_streaming.wait(120) and stream.error is None, stream.error
    began = time.monotonic()
    status = post_big(url, TOTAL, chunked=chunked)
    took = time.monotonic() - began
    stream.join(120)
    assert status == 413 and took < BOUND_S, (status, took)
    assert stream.error is None and stream.last is not None, stream.error
    assert len(stream.last["output_ids"]) == STREAMED, stream.last
    assert stream.longest_gap() < BOUND_S, stream.longest_gap()
    after = httpx.post(url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert after.status_code == 200, after.text
    if name == "router":  # the router refused it itself, and sent its workers nothing: none was ejected
        info = httpx.get(url + "/server_info", timeout=10).json()
        assert all(w["admitted"] for role in ("prefill", "decode") for w in info[role]), info
        # its limit is its workers' (each node's, from its context: the same for the colocated node's pool)
        assert info["max_request_bytes"] == httpx.get(targets["colocated"] + "/health").json()["max_request_bytes"]
