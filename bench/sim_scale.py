"""How ``fsm-pd simulate`` scales with the number of requests: it must stay linear (per-request cost flat).

Runs the simulation as ``fsm-pd simulate --requests N --seed S --fault-rate F`` does (journals on disk, durability
``normal``), once per size, and prints wall and CPU seconds and the CPU milliseconds per request. A check that scans
every room ever created at every step shows as a per-request cost that grows with N (it did: 6.1 s for 1,000
requests and 115 s for 4,000, when ``invariants.overdue_states`` scanned every room at each settle point).

    python bench/sim_scale.py [--sizes 1000,4000,16000,120000] [--seed 11] [--fault-rate 0.1] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from fsm_pd.sim import SimConfig, simulate


def measure(requests: int, seed: int, fault_rate: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="fsm-pd-sim-scale-") as journals:
        wall, cpu = time.perf_counter(), time.process_time()
        summary = simulate(SimConfig(requests=requests, seed=seed, fault_rate=fault_rate), journals)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"requests": requests, "wall_s": wall, "cpu_s": cpu, "cpu_ms_per_request": 1000 * cpu / requests,
            "succeeded": summary["succeeded"], "violations": len(summary["leaks"]["violations"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,4000,16000,120000", help="request counts, comma-separated")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--fault-rate", type=float, default=0.1)
    parser.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    args = parser.parse_args()
    if not args.json:
        print(f"{'requests':>9} {'wall s':>8} {'cpu s':>8} {'cpu ms/request':>15} {'succeeded':>10} {'violations':>10}")
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        r = measure(size, args.seed, args.fault_rate)
        results.append(r)
        if not args.json:
            print(f"{r['requests']:>9} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} {r['cpu_ms_per_request']:>15.2f} "
                  f"{r['succeeded']:>10} {r['violations']:>10}", flush=True)
    if args.json:
        print(json.dumps({"seed": args.seed, "fault_rate": args.fault_rate, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
