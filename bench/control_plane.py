"""Control-plane throughput: full sender + receiver lifecycles per second, and journaled transitions per second.

Each lifecycle is one room on both sides, from ``create`` to Success, through the real machines, the effect
interpreter (timers on a virtual clock, an in-process data plane and side channel that answer at once), the node
loop and two durable SQLite journals (``--durability``, default ``full``: fsync per group commit). ``--in-flight``
rooms move together, so each node step decides and commits a whole batch.

Repeats alternate between CPython's default GC thresholds and the serving policy that ``fsm-pd serve`` applies
(``fsm_pd.runtime.gc_policy``: freeze start-up objects, young collections 50x rarer); both are reported.

The baseline, measured in the same run: the same rows inserted into an empty SQLite file with the stdlib driver,
``executemany`` in batches of the same size, same WAL and synchronous setting. That is the ceiling for "write these
rows durably"; the ratio says how much of it the whole control plane keeps.

With ``--journal-url postgresql://...`` (a scratch database: its journal tables are dropped before each repeat) or
``--postgres`` (a private server started here from the Debian package's binaries, fsync on, stopped at the end), each
repeat also runs the same lifecycles with both nodes journaling to that one PostgreSQL database, as a fleet does
(``synchronous_commit`` follows ``--durability``), under the serving GC policy, and reports its transitions/s beside
SQLite's and the ratio.

    python bench/control_plane.py [--rooms 20000] [--in-flight 1000] [--repeats 5] [--postgres | --journal-url URL]
                                  [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fsm_pd.effects import EffectInterpreter, Node, VirtualClock
from fsm_pd.kvpool.pages import PageAllocator
from fsm_pd.machines import RECEIVER, SENDER
from fsm_pd.machines.effect_types import (
    FreePages,
    GatherAndPublish,
    Pull,
    ReleaseStaging,
    ReservePages,
    ResolveBootstrap,
    Scatter,
    Send,
)
from fsm_pd.runtime.gc_policy import SERVING_THRESHOLDS
from fsm_pd.store import Journal, read_journal
from fsm_pd.store.database import DURABILITY, PG_SYNCHRONOUS_COMMIT, journal_url
from fsm_pd.store.schema import metadata

LAYOUT = {"num_layers": 4, "num_pages": 1 << 20, "page_size": 16, "kv_heads": 2, "head_dim": 64,
          "dtype": "float32", "shard_axis": None}
DEADLINES_P = {"bootstrap": 300.0, "waiting": 300.0, "pull_hold": 300.0}
DEADLINES_D = {"bootstrap": 300.0, "admission": 300.0, "waiting": 300.0, "transfer": 300.0}
TO_PREFILL = {"PREPARE": "metadata_received", "PULLED": "pull_done", "ABORT": "peer_abort"}
TO_DECODE = {"READY": "kv_published", "ABORT": "peer_abort"}


def build_pair(prefill_journal, decode_journal, durability: str) -> tuple[Node, Node]:
    clock = VirtualClock()
    pages = PageAllocator(1 << 20)
    staging: dict[int, int] = {}
    nodes: dict[str, Node] = {}

    def send_to(role, table):
        def send(node, room, effect):
            body = {"peer_layout": LAYOUT, "uuid": room.room} if effect.kind in ("PREPARE", "READY") else {}
            nodes[role].submit(room.room, table[effect.kind], body)
        return send

    def gather(node, room, effect):
        staging[room.room] = room.room
        node.submit(room.room, "published", {"uuid": room.room})

    prefill = Node("prefill-0", SENDER, Journal(prefill_journal, durability=durability),
                   EffectInterpreter({GatherAndPublish: gather, Send: send_to("decode", TO_DECODE),
                                      ReleaseStaging: lambda n, r, e: staging.pop(r.room, None)}),
                   clock, DEADLINES_P)
    decode = Node("decode-0", RECEIVER, Journal(decode_journal, durability=durability),
                  EffectInterpreter({
                      ResolveBootstrap: lambda n, r, e: n.submit(r.room, "bootstrap_resolved", {"peer": "p"}),
                      ReservePages: lambda n, r, e: n.submit(r.room, "pages_reserved",
                                                            {"pages": pages.reserve(r.room, 4)}),
                      Send: send_to("prefill", TO_PREFILL),
                      Pull: lambda n, r, e: n.submit(r.room, "pulled", {}),
                      Scatter: lambda n, r, e: n.submit(r.room, "scattered", {}),
                      FreePages: lambda n, r, e: pages.free(r.room),
                  }), clock, DEADLINES_D)
    nodes.update(prefill=prefill, decode=decode)
    return prefill, decode


def run_lifecycles(rooms: int, in_flight: int, durability: str, journals: tuple) -> dict:
    prefill, decode = build_pair(*journals, durability)
    started = time.perf_counter()
    for first in range(1, rooms + 1, in_flight):
        batch = range(first, min(first + in_flight, rooms + 1))
        for room in batch:
            prefill.create(room, {"layout": LAYOUT})
            prefill.submit(room, "kv_ready")
            decode.create(room, {"layout": LAYOUT, "page_count": 4})
        while prefill.step() + decode.step():
            pass
        for room in batch:  # a served request is cleared, as the schedulers will
            prefill.clear(room)
            decode.clear(room)
    elapsed = time.perf_counter() - started
    rows = prefill.journal.rows_written + decode.journal.rows_written
    commits = prefill.journal.commits + decode.journal.commits
    for node in (prefill, decode):
        node.journal.close()
    return {"seconds": elapsed, "rows": rows, "commits": commits}


def raw_insert(rows: list[tuple], batch: int, durability: str, path: Path) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={DURABILITY[durability]}")
    conn.execute("CREATE TABLE transitions (seq INTEGER PRIMARY KEY AUTOINCREMENT, node TEXT, role TEXT, "
                 "room INTEGER, version INTEGER, trigger TEXT, src TEXT, dst TEXT, payload TEXT, at REAL, "
                 "UNIQUE(node, role, room, version))")
    sql = ("INSERT INTO transitions (node, role, room, version, trigger, src, dst, payload, at) "
           "VALUES (?,?,?,?,?,?,?,?,?)")
    started = time.perf_counter()
    for i in range(0, len(rows), batch):
        conn.execute("BEGIN")
        conn.executemany(sql, rows[i:i + batch])
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - started
    conn.close()
    return elapsed


def measure(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run = run_lifecycles(args.rooms, args.in_flight, args.durability, (tmp / "prefill.db", tmp / "decode.db"))
        rows = [(r.node, r.role, r.room, r.version, r.trigger, r.src, r.dst, json.dumps(r.payload), r.at)
                for name in ("prefill.db", "decode.db") for r in read_journal(tmp / name)]
        # the raw baseline commits as often as the node loop did, so both pay the same number of fsyncs
        batch = max(1, len(rows) // max(1, run["commits"]))
        raw_seconds = raw_insert(rows, batch, args.durability, tmp / "raw.db")
    transitions = run["rows"] / run["seconds"]
    raw = len(rows) / raw_seconds
    return {"lifecycles": args.rooms / run["seconds"], "transitions": transitions, "raw": raw,
            "ratio": transitions / raw, "rows_per_lifecycle": round(run["rows"] / args.rooms, 2)}


def libpq_url(url: str) -> str:
    """The URL as libpq (psycopg.connect) takes it: no SQLAlchemy driver suffix."""
    from sqlalchemy.engine import make_url

    return make_url(journal_url(url)).set(drivername="postgresql").render_as_string(hide_password=False)


def raw_insert_postgres(rows: list[tuple], batch: int, durability: str, url: str) -> float:
    """The PostgreSQL ceiling: the same rows, batches and synchronous_commit through psycopg's executemany."""
    import psycopg

    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(f"SET synchronous_commit TO {PG_SYNCHRONOUS_COMMIT[durability]}")
        conn.execute("DROP TABLE IF EXISTS bench_raw_transitions")
        conn.execute("CREATE TABLE bench_raw_transitions (seq BIGSERIAL PRIMARY KEY, node TEXT, role TEXT, "
                     "room BIGINT, version INTEGER, trigger TEXT, src TEXT, dst TEXT, payload TEXT, "
                     "at DOUBLE PRECISION, UNIQUE(room, role, node, version))")
        sql = ("INSERT INTO bench_raw_transitions (node, role, room, version, trigger, src, dst, payload, at) "
               "VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s)")
        started = time.perf_counter()
        for i in range(0, len(rows), batch):
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(sql, rows[i:i + batch])
        elapsed = time.perf_counter() - started
        conn.execute("DROP TABLE bench_raw_transitions")
    return elapsed


def measure_postgres(args, url: str) -> dict:
    """The same lifecycles, both nodes journaling to one PostgreSQL database (a fleet's journal), from empty tables."""
    from sqlalchemy import create_engine

    engine = create_engine(journal_url(url))
    metadata.drop_all(engine)
    engine.dispose()
    run = run_lifecycles(args.rooms, args.in_flight, args.durability, (url, url))
    rows = [(r.node, r.role, r.room, r.version, r.trigger, r.src, r.dst, json.dumps(r.payload), r.at)
            for r in read_journal(url)]
    assert len(rows) == run["rows"], "the database does not hold every row the nodes wrote"
    raw_seconds = raw_insert_postgres(rows, max(1, len(rows) // max(1, run["commits"])), args.durability, url)
    transitions = run["rows"] / run["seconds"]
    raw = len(rows) / raw_seconds
    return {"lifecycles": args.rooms / run["seconds"], "transitions": transitions, "raw": raw,
            "ratio": transitions / raw}


def postgres_target(args, stack: contextlib.ExitStack) -> str | None:
    """The PostgreSQL URL to measure: --journal-url, or a private server started for --postgres."""
    if args.journal_url:
        return args.journal_url
    if not args.postgres:
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
    from postgres_server import PostgresServer  # the tests' harness: initdb in a temp dir, 127.0.0.1, stop by PID

    server = stack.enter_context(PostgresServer(fsync=True))
    print(f"  PostgreSQL {server.bin} on 127.0.0.1:{server.port} (fsync on)", file=sys.stderr)
    return server.create_database("bench")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rooms", type=int, default=20000, help="lifecycles per repeat (default 20000)")
    parser.add_argument("--in-flight", type=int, default=1000, help="rooms moving together (default 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats per GC policy; medians reported (default 5)")
    parser.add_argument("--durability", choices=sorted(DURABILITY), default="full")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--journal-url", metavar="URL",
                       help="also measure a PostgreSQL journal at this URL (postgresql://user@host/db): a scratch "
                            "database, whose journal tables are dropped before each repeat")
    where.add_argument("--postgres", action="store_true",
                       help="also measure a PostgreSQL journal on a private server started here (needs PostgreSQL's "
                            "binaries: apt-get install postgresql) and psycopg (pip install 'fsm-pd[postgres]')")
    args = parser.parse_args()

    default_thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()  # start-up objects (imports) are frozen for both policies; only the thresholds differ
    results = {"default_gc": [], "serving_gc": []}
    with contextlib.ExitStack() as stack:
        pg_url = postgres_target(args, stack)  # first: the server is another machine's work, not held to our core
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the target is per core: hold us to one
        if pg_url:
            results["postgres"] = []
        for i in range(args.repeats):
            for policy, thresholds in (("default_gc", default_thresholds), ("serving_gc", SERVING_THRESHOLDS)):
                gc.set_threshold(*thresholds)
                results[policy].append(measure(args))
                if not args.json:
                    r = results[policy][-1]
                    print(f"  repeat {i + 1}/{args.repeats} {policy}: {r['lifecycles']:,.0f} lifecycles/s, "
                          f"{r['transitions']:,.0f} transitions/s, raw {r['raw']:,.0f} rows/s", file=sys.stderr)
            if pg_url:  # under the serving GC policy, still set: what fsm-pd serve runs with
                results["postgres"].append(measure_postgres(args, pg_url))
                if not args.json:
                    r = results["postgres"][-1]
                    print(f"  repeat {i + 1}/{args.repeats} postgres: {r['lifecycles']:,.0f} lifecycles/s, "
                          f"{r['transitions']:,.0f} transitions/s, raw {r['raw']:,.0f} rows/s", file=sys.stderr)
    gc.set_threshold(*default_thresholds)

    def median(policy, key):
        return statistics.median(r[key] for r in results[policy])

    figures = {
        "rooms": args.rooms, "in_flight": args.in_flight, "repeats": args.repeats, "durability": args.durability,
        "rows_per_lifecycle": results["serving_gc"][-1]["rows_per_lifecycle"],
        "raw_insert_rows_per_s_median": round(median("serving_gc", "raw")),
        "targets": {"lifecycles_per_s": 10000, "ratio_to_raw_insert": 0.3},
    }
    if "postgres" in results:
        sqlite = median("serving_gc", "transitions")
        figures["postgres"] = {
            "lifecycles_per_s_median": round(median("postgres", "lifecycles")),
            "journaled_transitions_per_s_median": round(median("postgres", "transitions")),
            "raw_insert_rows_per_s_median": round(median("postgres", "raw")),
            "ratio_to_raw_insert_median": round(median("postgres", "ratio"), 3),
            "ratio_to_sqlite_median": round(median("postgres", "transitions") / sqlite, 3),
        }
    for policy in ("default_gc", "serving_gc"):
        figures[policy] = {
            "lifecycles_per_s_median": round(median(policy, "lifecycles")),
            "journaled_transitions_per_s_median": round(median(policy, "transitions")),
            "ratio_to_raw_insert_median": round(median(policy, "ratio"), 3),
        }
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"{'':34}{'default GC':>14}{'serving GC':>14}   target")
    for key, label, target in (("lifecycles_per_s_median", "lifecycles/s (median)", ">= 10,000"),
                               ("journaled_transitions_per_s_median", "journaled transitions/s", ""),
                               ("ratio_to_raw_insert_median", "ratio to raw insert ceiling", ">= 0.3")):
        a, b = figures["default_gc"][key], figures["serving_gc"][key]
        fmt = "{:>14,}" if isinstance(a, int) else "{:>14}"
        print(f"{label:34}{fmt.format(a)}{fmt.format(b)}   {target}")
    print(f"{'raw batched SQLite insert rows/s':34}{figures['raw_insert_rows_per_s_median']:>28,}")
    print(f"({figures['rows_per_lifecycle']} journaled rows per lifecycle, durability {args.durability})")
    if "postgres" in figures:
        pg = figures["postgres"]
        print(f"\nPostgreSQL, both nodes in one database (serving GC; synchronous_commit "
              f"{PG_SYNCHRONOUS_COMMIT[args.durability]}):")
        print(f"{'journaled transitions/s (median)':34}{pg['journaled_transitions_per_s_median']:>14,}   "
              f"SQLite {figures['serving_gc']['journaled_transitions_per_s_median']:,}: "
              f"ratio {pg['ratio_to_sqlite_median']}")
        print(f"{'lifecycles/s (median)':34}{pg['lifecycles_per_s_median']:>14,}")
        print(f"{'raw batched PostgreSQL insert rows/s':34}{pg['raw_insert_rows_per_s_median']:>14,}   "
              f"ratio to it {pg['ratio_to_raw_insert_median']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
