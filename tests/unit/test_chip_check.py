"""bench/chip_check.py's machinery on this machine, in seconds: parts run in turn, each under its own limit (one that
hangs is stopped with everything it started, and the next still runs), an absent part is recorded missing, and
check.json and check.md say what each part did. The real plan names scripts that exist and flags they take."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

# appended, not put first: a bench module must never shadow an installed package for the rest of the run
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import chip_check  # noqa: E402

PY = sys.executable


def test_parts_run_in_turn_each_under_its_own_limit_and_the_tables_say_what_happened(tmp_path, monkeypatch):
    monkeypatch.setattr(chip_check, "GRACE_S", 1)
    grandchild = tmp_path / "grandchild.pid"
    plan = [
        chip_check.Part("answers", [PY, "-c", "import json, sys; open(sys.argv[1], 'w').write(json.dumps("
                                              "{'answer': 42, 'unit': 'ms'}))", str(tmp_path / "a.json")],
                        30, results=tmp_path / "a.json"),
        # a hang that started a process of its own, which must not outlive the part
        chip_check.Part("hangs", ["bash", "-c", f"sleep 300 & echo $! > {grandchild}; wait"], 2),
        chip_check.Part("fails", [PY, "-c", "print('it broke'); raise SystemExit(3)"], 30),
        chip_check.Part("absent", [PY, "nowhere.py"], 30, needs=tmp_path / "nowhere.py"),
    ]
    began = time.monotonic()
    report = chip_check.check(tmp_path / "out", plan)
    assert time.monotonic() - began < 20  # the hang cost its own 2 s and the grace, not the minutes it asked for
    parts = report["parts"]
    assert {name: r["status"] for name, r in parts.items()} == {
        "answers": "ok", "hangs": "timeout", "fails": "failed", "absent": "missing"}
    assert parts["answers"]["figures"] == {"answer": 42, "unit": "ms"} and parts["fails"]["exit"] == 3
    assert "it broke" in Path(parts["fails"]["log"]).read_text()
    pid = int(grandchild.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the hung part's own child outlived the part"
    assert json.loads((tmp_path / "out" / "check.json").read_text())["parts"] == parts
    table = (tmp_path / "out" / "check.md").read_text()
    assert "| answers | ok |" in table and "answer: 42, unit: ms |" in table
    assert "| hangs | timeout |" in table and "| fails | failed |" in table
    assert "| absent | missing | 0.0 | 30 | " in table and "nowhere.py is not in this tree" in table


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie no one reaped yet counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_the_suite_part_is_summed_up_from_its_summary():
    record = {"status": "failed", "seconds": 1.0, "log": "suite.log", "figures": {
        "tests": 3, "counts": {"passed": 2, "failed": 1, "skipped": 0}, "failures": [{"nodeid": "t"}], "running": []}}
    assert chip_check.brief("suite", record) == "3 tests: 2 passed, 1 failed; 1 not passed (below)"


def test_the_plan_names_scripts_that_exist_and_flags_they_take(tmp_path):
    plan = chip_check.parts(tmp_path, chip_check.LIMITS)
    assert [p.name for p in plan] == ["suite", "parity", "tpu", "load"]
    assert sum(chip_check.LIMITS.values()) <= 540  # inside 9 minutes
    load = plan[3].argv
    targets = load[load.index("--targets") + 1].split(",")  # the load bench compares a colocated node with a pd one
    assert targets[0] == "colocated" and len(targets) == 2 and targets[1].startswith("pd-"), targets
    import load_targets

    assert set(targets) <= set(load_targets.TARGETS)
    suite = plan[0]
    assert suite.needs.exists() and int(suite.env["FSM_PD_SUITE_LIMIT"]) < suite.limit_s
    for part in plan[1:]:
        if not part.needs.exists():  # bench/load.py may not be in this tree yet: recorded missing
            continue
        script = part.argv[1]
        usage = subprocess.run([PY, script, "--help"], cwd=chip_check.ROOT, capture_output=True, text=True,
                               timeout=60, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert usage.returncode == 0, usage.stderr
        for flag in (a for a in part.argv[2:] if a.startswith("--")):
            assert flag in usage.stdout, (script, flag)
