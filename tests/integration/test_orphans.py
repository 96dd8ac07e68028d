"""No server a test starts outlives the test process that started it, however that one ends: SIGKILLed, the
process's teardown never runs (a pytest-xdist worker killed, a run stopped by ``timeout``), and its nodes once stayed
on, holding their ports, until a later run failed on one (``processes.dies_with_parent``).

A throwaway Python process stands in for the test process: it starts a node as the suite does (``processes.Cluster``)
and ``fsm-pd launch`` as ``test_launch.py`` does, says their PIDs (and those of the nodes launch started, its
grandchildren), and waits. The test SIGKILLs it and watches every one of them end. And every ``subprocess.Popen`` of
the tests is given its parent-death signal."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from processes import dies_with_parent

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
GONE_WITHIN_S = 10.0  # the node dies with it; launch, told by SIGTERM, stops its idle nodes in about a second or two

STAND_IN = """
import json, sys, time
from pathlib import Path

import psutil
from processes import Cluster, free_port
from test_launch import started

tmp = Path(sys.argv[1])
cluster = Cluster(tmp)
node = cluster.launch_node("colocated")  # not waited for yet: it starts beside launch
launch, _, _ = started(["--model", "tiny", "--no-warmup", "--port", str(free_port()), "--journal-dir",
                        str(tmp / "launch")])
Cluster.healthy([node])
grandchildren = [c.pid for c in psutil.Process(launch.pid).children()]
print(json.dumps({"node": node[1].pid, "launch": launch.pid, "launched": grandchildren}), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: with its parent gone, whoever adopted it may never reap it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def command(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.NoSuchProcess:  # it ended after all
        return []


def test_the_servers_a_killed_test_process_started_end_with_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    stand_in = subprocess.Popen([sys.executable, "-c", STAND_IN, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                                env=env, preexec_fn=dies_with_parent())
    started: list[int] = []
    try:
        line = stand_in.stdout.readline()
        assert line, f"the stand-in exited with {stand_in.wait()} before its servers were up"
        pids = json.loads(line)
        assert len(pids["launched"]) == 3, pids  # launch's prefill, decode and router
        started = [pids["node"], pids["launch"], *pids["launched"]]
        assert all(alive(pid) for pid in started)
        stand_in.send_signal(signal.SIGKILL)
        stand_in.wait()
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: command(pid) for pid in started if alive(pid)}
        assert not left, f"still running {GONE_WITHIN_S} s after their test process was SIGKILLed: {left}"
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait()
        for pid in started:  # the processes this test had started, left behind when it failed
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_every_process_the_tests_start_to_run_beside_them_dies_with_them():
    """A ``subprocess.Popen`` runs beside the test; ``subprocess.run`` waits for its child, which its ``timeout`` ends
    (a fresh ``fsm-pd`` CLI, ``ip``): the Popens are the servers."""
    bare = []
    for path in sorted([*TESTS.glob("integration/*.py"), *TESTS.glob("deploy/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "Popen" and \
                    not any(k.arg == "preexec_fn" for k in node.keywords):
                bare.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert not bare, f"started without processes.dies_with_parent: {bare}"
