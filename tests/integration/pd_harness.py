"""Shared harness of the two-process tests: a KVManager process (``pd_node.py``) per node, driven over stdin."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import dies_with_parent

from fsm_pd.kernels import KVLayout
from fsm_pd.store import read_journal, replay
from fsm_pd.transport import generate_secret, secret_env

NODE = Path(__file__).with_name("pd_node.py")
SMALL = KVLayout(num_layers=2, num_pages=64, page_size=4, kv_heads=2, head_dim=8)
# 128 KiB per page over all layers: 512 pages are 64 MiB
LARGE = KVLayout(num_layers=4, num_pages=520, page_size=16, kv_heads=4, head_dim=64)
BACKENDS = ["zmq", "jax", "tcp"]


class NodeProcess:
    def __init__(
        self,
        tmp: Path,
        role: str,
        backend: str,
        layout: KVLayout,
        secret: bytes,
        *,
        seed=None,
        deadlines=None,
        pull_delay=0.0,
        backend_options=None,
        env=None,
        name=None,
        bootstrap_port=None,
        heartbeat=None,
        kv_checksum=True,
    ):
        self.role, self.name = role, name or f"{role}-0"
        self.journal = tmp / f"{self.name}.db"
        self.args = [
            sys.executable,
            str(NODE),
            "--role",
            role,
            "--node-id",
            self.name,
            "--journal",
            str(self.journal),
            "--backend",
            backend,
            "--layout",
            json.dumps(layout.to_dict()),
            "--deadlines",
            json.dumps(deadlines or {}),
            "--backend-options",
            json.dumps(backend_options or {}),
            "--heartbeat",
            json.dumps(heartbeat or {}),
        ]
        if bootstrap_port is not None:
            self.args += ["--bootstrap-port", str(bootstrap_port)]
        if seed is not None:
            self.args += ["--seed", str(seed)]
        if not kv_checksum:
            self.args += ["--kv-checksum", "off"]
        self.env = {**os.environ, **secret_env(secret), **(env or {})}
        if pull_delay:  # the node's fault injection holds each pull back this long
            self.env["FSM_PD_FAULT_PULL_DELAY_S"] = str(pull_delay)
        self._spawn()

    def start(self):
        self._spawn()
        return self.info

    def _spawn(self):
        """Start the process and return: the nodes of a test start side by side, and ``info`` waits for this one."""
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env,
                                     preexec_fn=dies_with_parent())
        self._info = None

    @property
    def info(self) -> dict:
        """What the node printed once ready (its addresses), read on first use."""
        return self._ready()

    def _ready(self) -> dict:
        if self._info is None:
            self._info = self._read(120)
        return self._info

    def _read(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{self.name} did not answer within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited with {self.proc.wait()}")
        return json.loads(line)

    def __call__(self, op, timeout=60, **fields):
        self._ready()  # its ready line comes before any answer
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        out = self._read(timeout)
        assert "error" not in out, out
        return out

    def kill(self):
        self.proc.kill()  # SIGKILL, to the process this test started
        self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            with contextlib.suppress(TimeoutError, RuntimeError, BrokenPipeError, AssertionError):
                self("quit", timeout=30)
            self.proc.wait(timeout=30)
        if self.proc.poll() is None:
            self.kill()


@pytest.fixture
def cluster(tmp_path):
    started = []
    secret = generate_secret()

    def start(role, backend, layout=SMALL, **kw):
        node = NodeProcess(tmp_path, role, backend, layout, secret, seed=1 if role == "prefill" else None, **kw)
        started.append(node)
        return node

    start.secret = secret
    yield start
    for node in started:
        node.stop()


def transfer(p, d, room, pages):
    p("add_sender", room=room, pages=pages)
    d("add_receiver", room=room, page_count=len(pages), prefill_addr=p.info["side_channel"])
    p("kv_ready", room=room, first_token=7)


def final(journal: Path, room: int) -> tuple[str, str | None, float, float]:
    """(final state, reason, first at, last state change at) of a room in a journal."""
    rows = [r for r in read_journal(journal) if r.room == room and r.role in ("prefill", "decode")]  # not records
    changes = [r for r in rows if r.src != r.dst]
    last = changes[-1] if changes else rows[-1]
    return last.dst, last.payload.get("reason"), rows[0].at, last.at


def assert_replay_consistent(*journals):
    result = replay([row for j in journals for row in read_journal(j)])
    assert result.consistent, [d.describe() for d in result.divergences]
    return result


def wait_for_state(node, room, state, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if node("state", room=room)["state"] == state:
            return
        time.sleep(0.02)
    raise AssertionError(f"{node.name} room {room} never reached {state}")
