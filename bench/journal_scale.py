"""Journal scale: replay and restart on a 1M-row journal, and the group-commit write rate, against baselines measured
in the same run.

The journal is built fast but real: room histories are harvested from a simulation (``fsm_pd.sim``: the production
machines, handlers and journal under seeded faults, so a realistic mix of succeeded and failed rooms on a prefill and
a decode node), then stamped out with fresh random room ids, shifted times and a request id in each create row (one
request in ten that failed is retried under the same id) and written with the production writer (``Journal.add`` /
``flush``, group commits of 2000 rows). Both nodes share the one file, so a node's restart has the whole journal
behind it. The last rooms are left open, as a crash would leave them.

Measured (medians of ``--repeats``):

- one room: ``fsm-pd replay --room R`` in this process (target < 0.5 s) and as a command; baseline: the whole-journal
  read that replay did before the room index (``read_journal`` + ``replay``), once, unless ``--skip-old``;
- ``fsm-pd replay --failed`` as a command: wall time and peak RSS (targets < 20 s, < 300 MB);
- ``fsm-pd replay --request RID`` in this process, for a retried request;
- restart: ``Node.recover`` of the prefill node from the open-room snapshot (target < 2 s) against the full-read
  recovery (``Node.restore`` of every row) on the same file; then ``fsm-pd serve --role prefill --model tiny`` from
  start to ``/health`` 200 on this journal against an empty one (``--skip-serve`` to leave it out);
- the control plane's journaled transitions per second against the raw SQLite insert ceiling (target >= 0.3x), by
  ``bench/control_plane.py``'s own ``measure``; baseline: the same writer with its ``rooms`` bookkeeping off.

    python bench/journal_scale.py [--rows 1000000] [--repeats 3] [--skip-old] [--skip-serve] [--json]
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from fsm_pd.cli.main import main as fsm_pd
from fsm_pd.effects import Node, RecordingInterpreter, VirtualClock
from fsm_pd.machines import SENDER, TERMINAL
from fsm_pd.sim import SimConfig, simulate
from fsm_pd.store import Journal, read_journal, replay

HERE = Path(__file__).resolve().parent
DEADLINES = {"bootstrap": 5.0, "waiting": 5.0, "pull_hold": 5.0}
OPEN_ROOMS = 200


def harvest(tmp: Path, seed: int) -> list[list[tuple]]:
    """Room histories from a simulation: per room, both sides' rows (COLUMNS order, payload as JSON text)."""
    simulate(SimConfig(requests=600, seed=seed, fault_rate=0.1), tmp, durability="off")
    rooms: dict[int, list[tuple]] = defaultdict(list)
    for name in ("prefill.db", "decode.db"):
        for r in read_journal(tmp / name):
            rooms[r.room].append((r.node, r.role, r.room, r.version, r.trigger, r.src, r.dst,
                                  json.dumps(r.payload, separators=(",", ":")), r.at))
    return [sorted(rows, key=lambda row: (row[8], row[1], row[3])) for _, rows in sorted(rooms.items())]


def build(path: Path, target_rows: int, seed: int) -> dict:
    """Write ``target_rows`` rows of stamped-out histories with the production writer; returns what it wrote."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as sim_dir:
        templates = harvest(Path(sim_dir), seed)
    journal = Journal(path, durability="off")
    written = rooms = failed = 0
    at = 1_764_547_200.0  # 2025-12-01 UTC
    retry_of: str | None = None
    retried: list[str] = []
    opened: list[int] = []
    while written < target_rows:
        template = templates[rooms % len(templates)]
        room = rng.getrandbits(62)
        rid = retry_of or f"req-{rooms}"
        if retry_of:
            retried.append(retry_of)
        start = template[0][8]
        leave_open = target_rows - written < OPEN_ROOMS * 8
        room_failed = False
        for node, role, _, version, trigger, src, dst, payload, t in template:
            if leave_open and dst in TERMINAL:
                break  # a crash left this room unfinished: only its rows before the end were committed
            if version == 0:
                payload = payload.replace('{"event":{', '{"event":{"rid":' + json.dumps(rid) + ",", 1)
            room_failed |= dst == "Failed"
            journal.add(node, role, room, version, trigger, src, dst, payload, at + (t - start))
            written += 1
            if journal.pending >= 2000:
                journal.flush()
        if leave_open:
            opened.append(room)
        failed += room_failed
        retry_of = rid if room_failed and not retry_of and rng.random() < 0.1 else None
        rooms += 1
        at += 0.01
    journal.close()
    return {"rows": written, "rooms": rooms, "rooms_failed": failed, "open_rooms": len(opened),
            "retried_rid": retried[len(retried) // 2] if retried else None, "some_room": _middle_room(path),
            "bytes": path.stat().st_size}


def _middle_room(path: Path) -> int:
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        count = conn.execute("SELECT count(*) FROM rooms").fetchone()[0]
        return conn.execute("SELECT room FROM rooms LIMIT 1 OFFSET ?", (count // 2,)).fetchone()[0]
    finally:
        conn.close()


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), out


def quiet(argv: list[str]) -> int:
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        return fsm_pd(argv)


def command(argv: list[str]) -> tuple[float, float, int, float]:
    """Wall seconds, peak RSS (MB), exit status and CPU seconds (user + system) of ``python -m fsm_pd.cli ARGV``,
    from its own rusage. On a shared machine the CPU time is the steadier figure."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fsm_pd.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return (time.perf_counter() - started, usage.ru_maxrss / 1024, proc.returncode,
            usage.ru_utime + usage.ru_stime)


def recover_seconds(path: Path, full_scan: bool) -> tuple[float, int]:
    node = Node("prefill-0", SENDER, Journal(path, durability="off"), RecordingInterpreter(), VirtualClock(),
                DEADLINES)
    started = time.perf_counter()
    if full_scan:  # recovery as it was before the rooms table: every row of the journal
        ids = node.restore(row for row in read_journal(node.journal.url) if row.node == node.node_id)
    else:
        ids = node.recover()
    elapsed = time.perf_counter() - started
    node.journal.engine.dispose()
    return elapsed, len(ids)


def serve_to_health(journal: Path, workdir: Path) -> float:
    """Seconds from ``fsm-pd serve --role prefill --model tiny`` to /health 200 (the node is then stopped)."""
    from fsm_pd.cli.launch import free_port

    ports = [free_port(), free_port()]
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fsm_pd.cli", "serve", "--role", "prefill", "--model", "tiny",
                             "--port", str(ports[0]), "--bootstrap-port", str(ports[1]), "--journal", str(journal),
                             "--node-id", "prefill-0", "--side-channel-secret", os.urandom(16).hex()],
                            cwd=workdir, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - started < 300:
            if proc.poll() is not None:
                raise RuntimeError(f"fsm-pd serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - started
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("no /health 200 within 300 s")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_rate(repeats: int) -> dict:
    """The control plane's write rate with the ``rooms`` table kept (today) and without it (the writer before it:
    the same code with its room bookkeeping switched off), alternating, each against the raw insert ceiling."""
    sys.path.insert(0, str(HERE))
    import control_plane  # bench/control_plane.py: its lifecycles and raw-insert baseline, not a copy of them

    import fsm_pd.store.journal as journal_module
    from fsm_pd.runtime.gc_policy import SERVING_THRESHOLDS

    args = argparse.Namespace(rooms=20000, in_flight=1000, durability="full")
    keeps_rooms = journal_module._room_changes
    runs: dict[str, list[dict]] = {"with_rooms": [], "without_rooms": []}
    # Measured as `fsm-pd serve` runs (its GC policy: control_plane.py's "serving GC" column), with what this process
    # built so far frozen: with default thresholds the young collections rescan the 1M-row build's leftovers, which
    # cost a quarter of the rate (0.238 against 0.318 by control_plane.py itself, same quiet machine)
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_THRESHOLDS)
    try:
        for _ in range(repeats):
            runs["with_rooms"].append(control_plane.measure(args))
            journal_module._room_changes = lambda rows: ([], [])
            try:
                runs["without_rooms"].append(control_plane.measure(args))
            finally:
                journal_module._room_changes = keeps_rooms
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    return {kind: {"journaled_transitions_per_s": round(statistics.median(r["transitions"] for r in found)),
                   "raw_insert_rows_per_s": round(statistics.median(r["raw"] for r in found)),
                   "ratio": round(statistics.median(r["ratio"] for r in found), 3)}
            for kind, found in runs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="journal rows to build (default 1,000,000)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats per measurement; medians (default 3)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--skip-old", action="store_true", help="leave out the whole-journal baselines")
    parser.add_argument("--skip-serve", action="store_true", help="leave out fsm-pd serve to /health")
    parser.add_argument("--write-only", action="store_true", help="only the write rate (with and without the "
                        "rooms table), as JSON")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args()
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    out: dict = {"targets": {"one_room_s": 0.5, "failed_s": 20, "failed_peak_rss_mb": 300, "recover_s": 2,
                             "write_ratio": 0.3}}
    with tempfile.TemporaryDirectory() as tmp:
        if args.write_only:
            out["write"] = write_rate(args.repeats)
            print(json.dumps(out["write"]))
            return 0
        tmp = Path(tmp)
        path = tmp / "journal.db"
        started = time.perf_counter()
        out["journal"] = built = build(path, args.rows, args.seed)
        built["build_s"] = round(time.perf_counter() - started, 1)
        say(f"built {built['rows']:,} rows, {built['rooms']:,} rooms ({built['rooms_failed']:,} failed, "
            f"{built['open_rooms']} open), {built['bytes'] / 1e6:.0f} MB in {built['build_s']} s")
        j, room, rid = str(path), str(built["some_room"]), built["retried_rid"]

        seconds, status = timed(lambda: quiet(["replay", j, "--room", room, "--format", "json"]), args.repeats)
        assert status == 0, status
        out["one_room_s"] = round(seconds, 4)
        out["one_room_command_s"] = round(statistics.median(
            command(["replay", j, "--room", room])[0] for _ in range(args.repeats)), 3)  # python start and imports
        say(f"one room: {out['one_room_s']} s in process, {out['one_room_command_s']} s as a command")
        if rid:
            seconds, status = timed(lambda: quiet(["replay", j, "--request", rid, "--format", "json"]), args.repeats)
            assert status == 0, status
            out["request_s"] = round(seconds, 4)
            say(f"one request ({rid}, retried): {out['request_s']} s")

        failed = [command(["replay", j, "--failed"]) for _ in range(args.repeats)]
        assert all(f[2] == 0 for f in failed), failed
        out["failed_s"] = round(statistics.median(f[0] for f in failed), 2)
        out["failed_peak_rss_mb"] = round(statistics.median(f[1] for f in failed))
        out["failed_cpu_s"] = round(statistics.median(f[3] for f in failed), 2)
        say(f"--failed: {out['failed_s']} s ({out['failed_cpu_s']} s of CPU), peak RSS {out['failed_peak_rss_mb']} MB")

        runs = [recover_seconds(path, full_scan=False) for _ in range(args.repeats)]
        out["recover_s"] = round(statistics.median(r[0] for r in runs), 4)
        out["recovered_rooms"] = runs[0][1]
        say(f"restart, snapshot recovery: {out['recover_s']} s ({runs[0][1]} open rooms)")
        if not args.skip_old:
            seconds, rows = timed(lambda: replay(read_journal(path)).rooms, 1)
            out["old_one_room_s"] = round(seconds, 2)
            say(f"  old one room (whole-journal read and replay): {out['old_one_room_s']} s")
            full = recover_seconds(path, full_scan=True)
            assert full[1] == out["recovered_rooms"], (full, runs[0])
            out["old_recover_s"] = round(full[0], 2)
            say(f"  old restart (full-read recovery): {out['old_recover_s']} s, "
                f"{out['old_recover_s'] / max(out['recover_s'], 1e-9):,.0f}x the snapshot's")
        if not args.skip_serve:
            empty = tmp / "empty.db"
            Journal(empty).close()
            out["serve_health_s"] = round(serve_to_health(path, tmp), 2)
            out["serve_health_empty_journal_s"] = round(serve_to_health(empty, tmp), 2)
            say(f"fsm-pd serve to /health: {out['serve_health_s']} s on this journal, "
                f"{out['serve_health_empty_journal_s']} s on an empty one")

    out["write"] = write_rate(args.repeats)
    for kind, w in out["write"].items():
        say(f"write, {kind.replace('_', ' ')} table: {w['journaled_transitions_per_s']:,} journaled transitions/s, "
            f"raw insert ceiling {w['raw_insert_rows_per_s']:,} rows/s, ratio {w['ratio']}")
    if args.json:
        print(json.dumps(out))
        return 0
    t = out["targets"]
    print(f"{'':36}{'median':>12}{'target':>12}{'baseline':>12}")
    rows = [("one room, in process (s)", out["one_room_s"], f"< {t['one_room_s']}", out.get("old_one_room_s", "")),
            ("one room, command (s)", out["one_room_command_s"], "", ""),
            ("--failed, command (s)", out["failed_s"], f"< {t['failed_s']}", ""),
            ("--failed, its CPU time (s)", out["failed_cpu_s"], "", ""),
            ("--failed peak RSS (MB)", out["failed_peak_rss_mb"], f"< {t['failed_peak_rss_mb']}", ""),
            ("restart: Node.recover (s)", out["recover_s"], f"< {t['recover_s']}", out.get("old_recover_s", "")),
            ("serve to /health (s)", out.get("serve_health_s", ""), "", out.get("serve_health_empty_journal_s", "")),
            ("write ratio to raw insert", out["write"]["with_rooms"]["ratio"], f">= {t['write_ratio']}",
             out["write"]["without_rooms"]["ratio"])]
    if "request_s" in out:
        rows.insert(2, ("one request, in process (s)", out["request_s"], "", ""))
    for label, value, target, base in rows:
        print(f"{label:36}{value!s:>12}{target:>12}{base!s:>12}")
    print(f"(journal: {out['journal']['rows']:,} rows, {out['journal']['rooms']:,} rooms, "
          f"{out['journal']['bytes'] / 1e6:.0f} MB; baselines: whole-journal read and replay, full-read recovery, "
          "serve on an empty journal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
