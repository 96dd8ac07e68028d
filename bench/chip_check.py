"""The chip check: the suite and the quick benches, one after the other, in one command inside 9 minutes on a TPU host.

    python3 bench/chip_check.py --out DIR [--limits suite=300,parity=50,tpu=65,load=120]

Parts, in this order, each a process of its own (one process at a time can hold the chip) under its own time limit,
so that one that hangs loses its own minutes and no more:

- ``suite``: ``bash tests/on_tpu.sh`` (the chip tests in one process, the rest on CPU workers); its records and
  summary land in ``DIR/suite/``;
- ``parity``: ``bench/chip_parity.py --quick`` (greedy answers, device against a float32 CPU reference);
- ``tpu``: ``bench/tpu.py --quick`` (steps and copies against their rooflines);
- ``load``: ``bench/load.py --quick --cold --background-timeout 20 --targets colocated,pd-always`` (streamed chats
  under load, a colocated node against ``--role pd``; one start per target, which waits at most 20 s for its
  background compile: a check that the bench runs, not its warm figures), recorded as ``missing`` where that script
  is not in the tree.

It writes ``DIR/check.json`` (every part: status ``ok``, ``failed``, ``timeout`` or ``missing``, seconds, exit status,
its log, the figures its own JSON holds) and ``DIR/check.md`` (one table, then each part's own table), rewritten after
every part, so a check stopped half-way still leaves what it did. Each part's output goes to ``DIR/PART.log``. A part
past its limit gets SIGTERM (the suite then prints its summary), then SIGKILL 20 s later. Exit status 0 only when
every part present is ``ok``. It runs on a CPU too (the parts do): ``tests/unit/test_chip_check.py`` runs its
machinery on small parts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 20  # after SIGTERM, before SIGKILL: the suite stops its runs and prints its summary meanwhile
LOAD_TARGETS = "colocated,pd-always"  # the load part's: a colocated node against --role pd, every request handed off


@dataclass
class Part:
    """One part of the check: a command run from the repo root, under ``limit_s``; ``needs`` is a file the part
    cannot run without (else it is recorded ``missing``); ``results`` the JSON file the part writes, if any."""

    name: str
    argv: list[str]
    limit_s: float
    needs: Path | None = None
    results: Path | None = None
    env: dict[str, str] = field(default_factory=dict)


def parts(out: Path, limits: dict[str, float]) -> list[Part]:
    py = sys.executable
    return [
        Part("suite", ["bash", "tests/on_tpu.sh"], limits["suite"], needs=ROOT / "tests/on_tpu.sh",
             results=out / "suite" / "summary.json",
             # the suite's own limit ends its runs, with its summary, a little before the check's for the part
             env={"FSM_PD_SUITE_OUT": str(out / "suite"), "FSM_PD_SUITE_LIMIT": str(int(limits["suite"]) - 25)}),
        Part("parity", [py, "bench/chip_parity.py", "--quick", "--json", str(out / "parity.json")],
             limits["parity"], needs=ROOT / "bench/chip_parity.py", results=out / "parity.json"),
        Part("tpu", [py, "bench/tpu.py", "--quick", "--json", str(out / "tpu.json"), "--markdown",
                     str(out / "tpu.md")], limits["tpu"], needs=ROOT / "bench/tpu.py", results=out / "tpu.json"),
        # two targets fit the part's limit (each takes its node's start, a warm-up wave and the three mixes: about
        # 40 s on the v5e); --quick alone runs four, and starts each twice (--cold: once), waiting for its
        # background compile as long as it takes (here at most 20 s, then a warning)
        Part("load", [py, "bench/load.py", "--quick", "--cold", "--background-timeout", "20", "--targets",
                      LOAD_TARGETS, "--json", str(out / "load.json")],
             limits["load"], needs=ROOT / "bench/load.py", results=out / "load.json"),
    ]


def run_part(part: Part, out: Path) -> dict:
    """Run one part under its limit; what happened, as ``check.json`` records it."""
    if part.needs is not None and not part.needs.exists():
        where = part.needs.relative_to(ROOT) if part.needs.is_relative_to(ROOT) else part.needs
        return {"status": "missing", "seconds": 0.0, "limit_s": part.limit_s, "why": f"{where} is not in this tree"}
    log = out / f"{part.name}.log"
    began = time.monotonic()
    with open(log, "w") as output:
        child = subprocess.Popen(part.argv, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT,
                                 env={**os.environ, **part.env}, start_new_session=True)
        try:
            status = child.wait(timeout=part.limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            stop(child)
            status = child.returncode
    record = {"status": "timeout" if timed_out else "ok" if status == 0 else "failed",
              "seconds": round(time.monotonic() - began, 1), "exit": status, "limit_s": part.limit_s,
              "log": str(log)}
    if part.results is not None and part.results.exists():
        try:
            record["figures"] = json.loads(part.results.read_text())
        except json.JSONDecodeError as exc:  # a part cut while writing it
            record["figures_error"] = str(exc)
    return record


def stop(child: subprocess.Popen) -> None:
    """SIGTERM to the part's process group (the part and what it started), SIGKILL after the grace."""
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 10)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def brief(name: str, record: dict) -> str:
    """One line of what a part's own JSON says."""
    figures = record.get("figures")
    if record["status"] == "missing":
        return record["why"]
    if not isinstance(figures, dict):
        return f"see {record['log']}"
    if name == "suite":
        counts = ", ".join(f"{n} {k}" for k, n in figures.get("counts", {}).items() if n)
        failed = len(figures.get("failures", [])) + len(figures.get("running", []))
        return f"{figures.get('tests', 0)} tests: {counts}" + (f"; {failed} not passed (below)" if failed else "")
    if name == "parity":
        return "; ".join(f"{model} {mode} ({f.get('kernels', '?')}): {f.get('agree', '?')}/"
                         f"{f.get('steps', f.get('tokens', '?'))} agree, "
                         f"{f.get('differ', '?')} differ" if "error" not in f else f"{model} {mode}: {f['error']}"
                         for model, modes in figures.get("models", {}).items() for mode, f in modes.items())
    if name == "tpu":
        steps = [f"{model} B{batch} {f['step_ms']} ms ({f['share']:.0%})"
                 for model, table in figures.get("models", {}).items()
                 for key, rows in table.items() if key.startswith("decode_pool_") and isinstance(rows, dict)
                 for batch, f in rows.items() if isinstance(f, dict) and "step_ms" in f]
        return f"{figures.get('device', '?')}: " + ", ".join(steps[:4])
    return ", ".join(f"{k}: {v}" for k, v in figures.items() if isinstance(v, int | float | str))[:300]


def markdown(report: dict, out: Path) -> str:
    lines = [f"Chip check, {report['started']}, {report['seconds']} s in all", "",
             "| part | status | seconds | limit | what it says |", "| --- | --- | ---: | ---: | --- |"]
    for name, record in report["parts"].items():
        lines.append(f"| {name} | {record['status']} | {record['seconds']} | {record.get('limit_s', '')} | "
                     f"{brief(name, record).replace('|', '/')} |")
    for name, table in (("suite", out / "suite" / "summary.md"), ("tpu", out / "tpu.md")):
        if name in report["parts"] and table.exists():
            lines += ["", f"### {name}", "", table.read_text().rstrip()]
    return "\n".join(lines) + "\n"


def check(out: Path, plan: list[Part]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": 0.0, "parts": {}}
    began = time.monotonic()
    for part in plan:
        print(f"chip_check: {part.name} (limit {part.limit_s:.0f} s) ...", flush=True)
        record = run_part(part, out)
        report["parts"][part.name] = record
        report["seconds"] = round(time.monotonic() - began, 1)
        print(f"chip_check: {part.name} {record['status']} in {record['seconds']} s: {brief(part.name, record)}",
              flush=True)
        (out / "check.json").write_text(json.dumps(report, indent=1))
        (out / "check.md").write_text(markdown(report, out))
    return report


# 535 s: inside 9 minutes with the starts. On the v5e (2026-12-06) parity took 29 s, tpu 43 s, and load's colocated
# target 40 s of its 80 (its two pd targets then failed to compile), with the suite cut at 275 s.
LIMITS = {"suite": 300.0, "parity": 50.0, "tpu": 65.0, "load": 120.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder for check.json, check.md and the logs")
    parser.add_argument("--limits", default="", help="seconds per part, e.g. suite=300,tpu=80 (defaults: "
                        + ", ".join(f"{k}={v:.0f}" for k, v in LIMITS.items()) + ")")
    parser.add_argument("--parts", default=",".join(LIMITS), help="which parts, in order")
    args = parser.parse_args(argv)
    limits = dict(LIMITS)
    for item in filter(None, args.limits.split(",")):
        name, _, seconds = item.partition("=")
        limits[name.strip()] = float(seconds)
    out = args.out.resolve()
    chosen = args.parts.split(",")
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from fsm_pd.cli.flags import expected_platform
    from fsm_pd.runtime.tpu_host_buffer import ask_for_buffer

    ask_for_buffer(expected_platform())  # every part opens the chip with the host buffer a node asks for
    report = check(out, [p for p in parts(out, limits) if p.name in chosen])
    print((out / "check.md").read_text())
    return 0 if all(r["status"] in ("ok", "missing") for r in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
