"""Write the golden journals: one scenario each, from the simulation, as reviewable JSON lines.

Run ``python tests/golden/make_golden.py`` only when a table change is intended; the diff of the .jsonl files is then
the behaviour change to review. The tests never regenerate them: they replay what is committed.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from fsm_pd.sim import SimConfig, World
from fsm_pd.store import read_journal

HERE = Path(__file__).resolve().parent


def success(world: World) -> None:
    world.add_request(1, 40, at=0.0)


def timeout(world: World) -> None:
    world.plan.forced_messages.append("drop")  # the decode node's PREPARE never arrives
    world.add_request(1, 40, at=0.0)


def prefill_crash(world: World) -> None:
    world.add_request(1, 40, at=0.0)
    world.clock.call_at(0.0035, world.crash_prefill)  # after READY, before PULLED


def abort(world: World) -> None:
    world.add_request(1, 40, at=0.0)
    world.clock.call_at(0.0025, lambda: world.abort("decode", 1, "client went away"))


SCENARIOS = {"success": success, "timeout": timeout, "prefill_crash": prefill_crash, "abort": abort}


def record(scenario) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        world = World(SimConfig(requests=0, seed=1), tmp)
        scenario(world)
        world.run()
        world.close()
        rows = read_journal(Path(tmp) / "prefill.db") + read_journal(Path(tmp) / "decode.db")
    keys = ("node", "role", "room", "version", "trigger", "src", "dst", "payload", "at")
    return [{k: getattr(r, k) for k in keys} for r in sorted(rows, key=lambda r: (r.at, r.role))]


def main() -> None:
    for name, scenario in SCENARIOS.items():
        rows = record(scenario)
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        if name == "success":
            tampered = [dict(r) for r in rows]
            victim = next(r for r in tampered if r["trigger"] == "scattered")
            victim["dst"] = "Failed"  # what an edited or corrupted journal looks like
            (HERE / "tampered.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in tampered))


if __name__ == "__main__":
    main()
