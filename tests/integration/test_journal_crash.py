"""SIGKILL in the middle of heavy journal writing, several times over: the journal stays a sound SQLite database,
replays consistently, and each restart fails exactly the rooms the dead process left unfinished (``node restarted``,
journaled) and then starts clean.

The victim is ``crash_writer.py``: a prefill ``Node`` on a real SQLite journal that group-commits batches of rows for
many rooms in a tight loop. It is killed at random moments (so some kills land inside a transaction or an fsync),
restarted on the same journal, and killed again. The last restart is a real ``KVManager``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from processes import dies_with_parent

from fsm_pd.control import KVManager
from fsm_pd.kernels import KVLayout
from fsm_pd.store import read_journal, replay
from fsm_pd.transport import generate_secret

HERE = Path(__file__).parent
WRITER = HERE / "crash_writer.py"
TERMINAL = ("Success", "Failed")
RESTARTED = "local error: node restarted"
ROUNDS = 5


def start_writer(path: Path, durability: str, seed: int) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, str(WRITER), str(path), durability, str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=dies_with_parent())
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"the writer died before it was ready: {proc.stderr.read()[-2000:]}")
    return proc, json.loads(line)


def committed_rows(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT count(*) FROM transitions").fetchone()[0]
    finally:
        conn.close()


def unfinished(path: Path) -> list[int]:
    """Rooms whose journaled history does not end in a terminal state, read with plain SQL (not fsm-pd's reader)."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT t.room, t.dst FROM transitions t JOIN (SELECT room, max(version) v FROM transitions GROUP BY room)"
            " last ON t.room = last.room AND t.version = last.v").fetchall()
    finally:
        conn.close()
    return sorted(room for room, dst in rows if dst not in TERMINAL)


def integrity(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [r[0] for r in conn.execute("PRAGMA integrity_check").fetchall()]
    finally:
        conn.close()


def fsm_pd_replay(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsm_pd.cli", "replay", *map(str, paths), "--failed", "--format",
                           "json"], capture_output=True, text=True, timeout=120)


def restart_reasons(path: Path, rooms: list[int]) -> dict[int, str]:
    """For each room, the reason journaled with its (applied, not ignored) transition to Failed by ``error``."""
    conn = sqlite3.connect(path)
    try:
        found = dict(conn.execute(
            "SELECT room, json_extract(payload, '$.reason') FROM transitions"
            " WHERE trigger = 'error' AND dst = 'Failed' AND src != 'Failed'").fetchall())
    finally:
        conn.close()
    return {room: found.get(room) for room in rooms}


def test_sigkill_mid_write_leaves_a_sound_journal_and_restarts_fail_the_unfinished(tmp_path):
    path = tmp_path / "prefill.db"
    rng = random.Random(20240607)
    kills, left_behind = 0, []
    for round_ in range(ROUNDS):
        expected = unfinished(path) if path.exists() else []
        before = committed_rows(path) if path.exists() else 0
        proc, hello = start_writer(path, ("full", "normal")[round_ % 2], seed=round_)
        try:
            time.sleep(rng.uniform(0.1, 0.4))  # the writer never stops: this lands anywhere in its loop
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        finally:
            proc.kill()
            proc.wait(timeout=10)
            proc.stdout.close()
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        assert integrity(path) == ["ok"], round_
        assert committed_rows(path) > before, "the writer was writing when it was killed"
        # the restart failed exactly what the last process left unfinished, and committed that before new work
        assert hello["recovered"] == expected, round_
        assert [room for room in unfinished(path) if room < hello["first_room"]] == []
        assert set(restart_reasons(path, expected).values()) <= {RESTARTED}
        left = unfinished(path)
        assert left, "a kill mid-run leaves rooms in flight"  # hundreds are live at any moment
        left_behind.append(len(left))

    # the journal after the last kill: sound, and fsm-pd replay agrees with every row
    assert kills == ROUNDS
    done = fsm_pd_replay(path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert all(r["consistent"] for r in report["rooms"])
    assert sum(r["reason"] == RESTARTED for r in report["rooms"]) >= sum(left_behind[:-1])

    # a real KVManager restarted on the journal fails what the last kill left, journals why, and starts clean
    expected = unfinished(path)
    layout = KVLayout(num_layers=1, num_pages=64, page_size=4, kv_heads=1, head_dim=8)
    pool = (np.zeros(layout.layer_shape, np.float32),)
    manager = KVManager(role="prefill", node_id="prefill-0", layout=layout, journal=str(path),
                        secret=generate_secret(), backend="fake", pool=pool)
    try:
        assert manager.recovered == expected
        deadline = time.monotonic() + 30
        while unfinished(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert unfinished(path) == []
        assert set(restart_reasons(path, expected).values()) == {RESTARTED}
        assert all(manager.reason(room) == RESTARTED for room in expected)
        # new work on the restarted node gets fresh rooms and runs normally
        room = max(r.room for r in read_journal(path)) + 1
        manager.add_sender(room, pages=[1, 2])
        manager.abort(room, "client went away")
        assert manager.wait(room, 10).name == "Failed" and manager.reason(room) == "client went away"
    finally:
        manager.close()
    assert integrity(path) == ["ok"]
    result = replay(read_journal(path))
    assert result.consistent and all(r.final in TERMINAL for r in result.rooms)
