"""The journal-at-scale features on PostgreSQL (a real server from ``postgres_server.py``): the rooms table kept in
the group commit, restart from the open-room snapshot equal to the full read, ``replay --request`` and retention
of a server journal into SQLite archives that ``replay URL`` reads back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from postgres_server import PostgresServer
from postgres_server import missing as postgres_missing

from fsm_pd.effects import Node, RecordingInterpreter, VirtualClock
from fsm_pd.machines import SENDER
from fsm_pd.store import Journal, read_journal
from fsm_pd.store.retention import Retention

pytestmark = pytest.mark.real_part("postgres", missing=postgres_missing())

LAYOUT = {"num_layers": 1, "num_pages": 4, "page_size": 2, "kv_heads": 1, "head_dim": 4}
DEADLINES = {"bootstrap": 5.0, "waiting": 5.0, "pull_hold": 5.0}
START = 1_764_547_200.0  # 2025-12-01 00:00 UTC


@pytest.fixture(scope="module")
def url():
    with PostgresServer(fsync=False) as server:
        yield server.create_database("scale")


def replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsm_pd.cli", "replay", *args], capture_output=True, text=True,
                          timeout=120)


def test_snapshot_restart_request_chain_and_archives_on_postgres(url, tmp_path):
    clock = VirtualClock(START)
    node = Node("p0", SENDER, Journal(url), RecordingInterpreter(), clock, DEADLINES)
    for room in range(40):
        node.create(room, {"layout": LAYOUT, "rid": f"req-{room // 2}"})  # two attempts per request
        if room % 4:
            node.submit(room, "abort", {"reason": "client went away"})
    node.step()
    node.journal.close()

    restarted = Node("p0", SENDER, Journal(url), RecordingInterpreter(), VirtualClock(START), DEADLINES)
    full = Node("p0", SENDER, Journal(url), RecordingInterpreter(), VirtualClock(START), DEADLINES)
    every_row = [row for row in read_journal(url) if row.node == "p0" and row.role == full.role]
    assert restarted.recover() == full.restore(every_row) == list(range(0, 40, 4))
    for n in (restarted, full):
        n.journal.engine.dispose()

    chain = replay(url, "--request", "req-3", "--format", "json")
    assert chain.returncode == 0, chain.stderr
    assert [a["room"] for a in json.loads(chain.stdout)["attempts"]] == [6, 7]

    node = Node("p0", SENDER, Journal(url), RecordingInterpreter(), VirtualClock(START + 3600), DEADLINES)
    policy = Retention(start_after_s=0, keep_s=60.0, max_rows=None, archive_dir=tmp_path, clock=lambda: START + 3600)
    policy.attach(node.journal)
    node.create(100, {"layout": LAYOUT})
    node.step()  # its commit runs the pass: the 30 aborted rooms move, the 10 open ones stay
    node.journal.close()
    assert policy.moved == 30
    archive = tmp_path / "scale.archive-2025-12.db"
    assert archive.is_file()
    whole = replay(url, "--format", "json")
    assert whole.returncode == 0, whole.stderr
    doc = json.loads(whole.stdout)
    assert doc["journals"][1] == str(archive) and str(archive) in whole.stderr
    assert sorted(r["room"] for r in doc["rooms"]) == [*range(40), 100]
