"""One PostgreSQL journal for a fleet, against a real PostgreSQL server (``postgres_server.py``: initdb in a temp dir,
127.0.0.1, stopped by PID). A real part (``tests/real_parts.py``): skipped, saying why, when PostgreSQL or psycopg is
not installed (``.ci/run`` installs both, and fails if these tests skip).

- The journal itself on PostgreSQL: 64-bit rooms, timestamps to the microsecond, two writers in one database,
  ``--durability`` as ``synchronous_commit``, the libpq timeouts, a version conflict, ``fsm-pd replay URL``.
- A 1P1D cluster (real ``fsm-pd serve`` processes, tiny model) both journaling to one database serves requests, and
  replay from the database alone explains every room on both nodes.
- The database stopped mid-run fails the nodes loudly: ``/health`` 503 naming the journal, requests fail with that
  reason, and nothing the nodes did is missing from the journal when the server comes back; an idle node notices
  too (its loop pings a server journal that has been quiet for 2 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from polling import until
from postgres_server import PostgresServer
from postgres_server import missing as postgres_missing
from processes import PAGE_SIZE, Cluster, free_port

from fsm_pd.effects import Node, RecordingInterpreter, VirtualClock
from fsm_pd.machines import SENDER
from fsm_pd.store import Journal, JournalError, VersionConflict, read_journal, replay

pytestmark = pytest.mark.real_part("postgres", missing=postgres_missing())

CREATE = ("Bootstrapping", "Bootstrapping")


@pytest.fixture(scope="module")
def pg():
    with PostgresServer(fsync=False) as server:  # a real server; fsync off only spares the shared test disk
        yield server


_dbs = iter(range(1, 1_000_000))


@pytest.fixture
def db(pg) -> tuple[str, str]:
    """A fresh database on the module's server: (name, URL as an operator writes it, ``postgresql://...``)."""
    name = f"journal{next(_dbs)}"
    return name, pg.create_database(name)


def fsm_pd_replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsm_pd.cli", "replay", *args], capture_output=True, text=True,
                          timeout=120)


# --- the journal on PostgreSQL ---

def test_rooms_and_times_keep_their_width(pg, db):
    name, url = db
    big = 2**63 - 1  # SGLang's router draws rooms up to here; INTEGER (32-bit) refused anything above 2**31
    at = 1_764_590_000.123456  # a Unix time: REAL (4 bytes) would keep it to the nearest 128 s
    journal = Journal(url)
    journal.add("prefill-0", "prefill", big, 0, "create", *CREATE, '{"event":{},"effects":[]}', at)
    journal.flush()
    assert journal.has_room("prefill-0", "prefill", big) and not journal.has_room("prefill-0", "prefill", 7)
    journal.close()
    [row] = read_journal(url)
    assert (row.room, row.at) == (big, at)
    assert pg.sql(name, "SELECT room, at FROM transitions") == [(big, at)]


def test_two_writers_one_database_replay_as_from_the_files(db, pg, tmp_path):
    """The rows of a simulated fleet (real machines, faults) written by two writers into one database replay
    exactly as the two SQLite journals they came from."""
    name, url = db
    # seed 3 at fault rate 0.2 fails some rooms and not others (at 0.3, since the simulation injects corrupted KV
    # and stalls, it failed all 24): the replay below must compare both kinds
    sim = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "simulate", "--requests", "12", "--seed", "3",
                          "--fault-rate", "0.2", "--journal-dir", str(tmp_path)], capture_output=True, timeout=120)
    assert sim.returncode == 0, sim.stderr
    files = [read_journal(tmp_path / f"{role}.db") for role in ("prefill", "decode")]
    writers = [Journal(url), Journal(url)]  # as two serve processes open it
    for i in range(max(map(len, files))):  # interleaved commits, one writer after the other
        for journal, rows in zip(writers, files, strict=True):
            if i < len(rows):
                r = rows[i]
                journal.add(r.node, r.role, r.room, r.version, r.trigger, r.src, r.dst, json.dumps(r.payload), r.at)
                journal.flush()
    for journal in writers:
        journal.close()
    order = [node for (node,) in pg.sql(name, "SELECT node FROM transitions ORDER BY seq")]
    assert order[:4] == ["prefill-0", "decode-0"] * 2  # one sequence across both writers, in commit order
    from_db = replay(read_journal(url))
    from_files = replay(files[0] + files[1])
    assert from_db.consistent and {r.node for r in from_db.rooms} == {"prefill-0", "decode-0"}
    assert {r.failed for r in from_db.rooms} == {True, False}, "the faults should have failed some rooms"
    key = lambda r: (r.room, r.role)  # noqa: E731
    assert [r.to_dict() for r in sorted(from_db.rooms, key=key)] == [
        r.to_dict() for r in sorted(from_files.rooms, key=key)]
    out = fsm_pd_replay(url, "--format", "json")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["rooms"]) == len(from_files.rooms)


def test_a_restarted_node_recovers_only_its_own_open_rooms(db):
    """Two prefill nodes share the tables; a restart of one fails its own open rooms and leaves the other's alone."""
    url = db[1]
    deadlines = {"bootstrap": 5.0, "waiting": 5.0, "pull_hold": 5.0}

    def prefill(node_id: str) -> Node:
        return Node(node_id, SENDER, Journal(url), RecordingInterpreter(), VirtualClock(), deadlines)

    first, second = prefill("prefill-0"), prefill("prefill-1")
    for node, rooms in ((first, (1, 2)), (second, (1, 3))):  # room 1 on both: rooms are per node
        for room in rooms:
            node.create(room, {"layout": {"num_layers": 1, "num_pages": 4, "page_size": 2, "kv_heads": 1,
                                          "head_dim": 4}})
        node.step()
    restarted = prefill("prefill-0")
    assert restarted.recover() == [1, 2]
    restarted.step()
    rows = read_journal(url)
    failed = sorted((r.node, r.room) for r in rows if r.trigger == "error" and r.dst == "Failed")
    assert failed == [("prefill-0", 1), ("prefill-0", 2)]
    for node in (first, second, restarted):
        node.journal.close()


@pytest.mark.parametrize(("durability", "setting"), [("full", "on"), ("normal", "off"), ("off", "off")])
def test_durability_is_synchronous_commit(db, durability, setting):
    journal = Journal(db[1], durability=durability)
    with journal.engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == setting
        params = conn.connection.dbapi_connection.info.get_parameters()  # what libpq was given
    assert params["connect_timeout"] == "5" and params["tcp_user_timeout"] == "30000"
    assert params["keepalives_idle"] == "10"
    journal.close()


def test_a_second_writer_of_the_same_version_is_a_conflict(db):
    one, two = Journal(db[1]), Journal(db[1])
    one.add("prefill-0", "prefill", 5, 0, "create", *CREATE, "{}", 1.0)
    one.flush()
    two.add("prefill-0", "prefill", 5, 0, "create", *CREATE, "{}", 2.0)
    with pytest.raises(VersionConflict):
        two.flush()
    one.close()
    two.engine.dispose()


def test_a_server_restarted_between_commits_is_reconnected_quietly():
    """The pooled connection died with the old server; it is pinged before use and replaced, so no commit fails."""
    with PostgresServer(fsync=False) as server:
        journal = Journal(server.create_database("journal"))
        for room, restart in ((1, True), (2, False)):
            journal.add("prefill-0", "prefill", room, 0, "create", *CREATE, "{}", 1.0)
            journal.flush()
            if restart:
                server.stop("fast")
                server.start()
        assert [r.room for r in read_journal(journal.url)] == [1, 2]
        journal.close()


def test_unreachable_server_fails_fast_and_names_the_journal():
    url = f"postgresql://fsm:pw-not-shown@127.0.0.1:{free_port()}/journal"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(JournalError) as err:
        Journal(url)
    assert time.monotonic() - started < 10
    assert "127.0.0.1" in str(err.value) and "pw-not-shown" not in str(err.value)
    out = fsm_pd_replay(url)
    assert out.returncode == 2 and "pw-not-shown" not in out.stderr and "127.0.0.1" in out.stderr


# --- a 1P1D cluster on one database ---

def generate(url: str, prompt: str, timeout: float = 120) -> httpx.Response:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    return httpx.post(url + "/generate", json=body, timeout=timeout)


def start_fleet(cluster: Cluster, journal: str) -> dict[str, str]:
    """Prefill (with its bootstrap server), decode and the built-in router; both nodes journal to ``journal``."""
    boot = free_port()
    urls = {}
    for role, extra in (("prefill", ["--bootstrap-port", str(boot)]), ("decode", [])):
        port = free_port()
        urls[role] = cluster.start(f"{role}-pg", [
            sys.executable, "-m", "fsm_pd.cli", "serve", "--role", role, "--port", str(port), "--page-size",
            str(PAGE_SIZE), "--transfer-backend", "tcp", "--node-id", f"{role}-pg", "--journal", journal, *extra],
            f"http://127.0.0.1:{port}")
    urls["router"] = cluster.router(urls["prefill"], boot, urls["decode"])
    return urls


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


def test_a_1p1d_cluster_journals_to_one_database(cluster, pg, db):
    name, url = db
    urls = start_fleet(cluster, url)
    prompts = ["Hi", "a" * (PAGE_SIZE + 1), "The quick brown fox", "x" * (PAGE_SIZE * 3)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: generate(urls["router"], p), prompts))
    assert [a.status_code for a in answers] == [200] * len(prompts), [a.text for a in answers]
    # plain SQL, not fsm-pd's reader: both nodes wrote here, and only here
    nodes = dict(pg.sql(name, "SELECT node, count(DISTINCT room) FROM transitions GROUP BY node"))
    assert nodes == {"prefill-pg": len(prompts), "decode-pg": len(prompts)}
    assert not list(cluster.tmp.glob("*.db")), "a node wrote a SQLite journal beside the database"
    out = fsm_pd_replay(url, "--format", "json")
    assert out.returncode == 0, out.stderr  # every room of both nodes replays consistently
    rooms = json.loads(out.stdout)["rooms"]
    by_room: dict[int, set] = {}
    for r in rooms:
        assert r["final"] == "Success" and r["consistent"], r
        by_room.setdefault(r["room"], set()).add((r["node"], r["role"]))
    assert len(by_room) == len(prompts)
    assert all(sides == {("prefill-pg", "prefill"), ("decode-pg", "decode")} for sides in by_room.values())
    rid = answers[0].json()["meta_info"]["id"]  # one request's story across both nodes, from the rooms table's rids
    out = fsm_pd_replay(url, "--request", rid, "--format", "json")
    assert out.returncode == 0, out.stderr
    [attempt] = json.loads(out.stdout)["attempts"]
    assert {(s["node"], s["role"]) for s in attempt["sides"]} == {("prefill-pg", "prefill"), ("decode-pg", "decode")}


def test_database_stopped_mid_run_fails_the_nodes_loudly(cluster, tmp_path):
    with PostgresServer(fsync=False) as server:  # its own server: this test stops it
        url = server.create_database("journal")
        urls = start_fleet(cluster, url)
        assert generate(urls["router"], "warm up").status_code == 200
        answers: list[httpx.Response | Exception] = []
        stop_sending = threading.Event()

        def send():  # a steady client across the outage
            while not stop_sending.is_set():
                try:
                    answers.append(generate(urls["router"], f"req {len(answers)}", timeout=60))
                except httpx.HTTPError as exc:
                    answers.append(exc)

        client = threading.Thread(target=send)
        client.start()
        assert until(lambda: len(answers) >= 2, timeout_s=120)
        server.stop("fast")  # the database goes away under load
        try:
            for role in ("prefill", "decode"):
                assert until(lambda r=role: _unhealthy(urls[r]), timeout_s=60), f"{role} still healthy"
                reason = _unhealthy(urls[role]).json()["reason"]
                assert "journal" in reason and f"127.0.0.1:{server.port}/journal" in reason, reason
        finally:
            stop_sending.set()
            client.join(timeout=120)
        failed = [a for a in answers if not isinstance(a, httpx.Response) or a.status_code != 200]
        assert failed, "no request failed while the database was down"
        last = answers[-1]
        assert isinstance(last, httpx.Response) and last.status_code >= 500 and "journal" in last.text, last

        server.start()  # back, on the same data: the stopped nodes stay stopped, and the journal has no gap
        assert all(_unhealthy(urls[role]) for role in ("prefill", "decode"))
        ok = sum(1 for a in answers if isinstance(a, httpx.Response) and a.status_code == 200) + 1  # + warm up
        rows = read_journal(url)
        result = replay(rows)
        assert result.consistent, [d.describe() for d in result.divergences]
        decoded = {r.room for r in result.rooms if r.node == "decode-pg" and r.final == "Success"}
        prefilled = {r.room for r in result.rooms if r.node == "prefill-pg"}
        # every answered request's decode side finished in the journal, and its prefill side is there too (its
        # Success may have been the one commit the outage refused: the pull_done after the decode node's pull)
        assert len(decoded) >= ok and decoded <= prefilled


def test_an_idle_node_notices_the_database_is_gone(cluster):
    """No request needs the journal, yet /health turns 503 within seconds: the loop pings an idle server journal."""
    with PostgresServer(fsync=False) as server:
        url = server.create_database("journal")
        port = free_port()
        node = cluster.start("decode-idle", [
            sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "decode", "--port", str(port), "--page-size",
            str(PAGE_SIZE), "--node-id", "decode-idle", "--journal", url], f"http://127.0.0.1:{port}")
        server.stop("fast")
        stopped = time.monotonic()
        assert until(lambda: _unhealthy(node), timeout_s=30), "an idle node still says it is healthy"
        assert time.monotonic() - stopped < 15
        reason = _unhealthy(node).json()["reason"]
        assert f"127.0.0.1:{server.port}/journal cannot be reached" in reason, reason


def _unhealthy(url: str) -> httpx.Response | None:
    try:
        answer = httpx.get(url + "/health", timeout=5)
    except httpx.HTTPError:
        return None
    return answer if answer.status_code == 503 else None
