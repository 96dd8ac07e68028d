#!/usr/bin/env bash
# The unit and property tests on a TPU host: `bash tests/on_tpu.sh` from the repo root (README, "On a TPU host";
# docs/tpu.md). Extra arguments go to both pytest runs (`-x`, `-k kernels`; not `-m`). CI does not run this.
#
# - Two pytest runs at once. The tests marked `chip` (device programs: kernels, model steps, handoffs on the device;
#   tests/conftest.py) run in one process, which takes the chip before any test runs: one process at a time can open
#   it, and the processes its tests start run jax on the CPU (tests/on_chip.py). The other tests run meanwhile on
#   pytest-xdist workers (FSM_PD_SUITE_WORKERS, default 8 of the host's 13 cores) with JAX_PLATFORMS=cpu, so that
#   none of them, nor any process they start, opens the chip. Without pytest-xdist they run in one CPU process.
#   The CPU half runs at nice 10 (FSM_PD_SUITE_CPU_NICE), it and every process it starts: the chip half is the
#   longer (on a v5e host the CPU half ended after about 170 s, the chip half ran on for 3 minutes more), and while
#   both ran the chip's process, compiling on the host's cores, competed with 8 workers and their nodes for them.
# - One persistent compile cache for both runs and the nodes their tests start (FSM_PD_SUITE_COMPILE_CACHE, default
#   $FSM_PD_COMPILE_CACHE, else the nodes' own default ~/.cache/fsm-pd/jax): a program is compiled once per run,
#   and a second run on the same host reads it back.
# - A time limit for the whole (FSM_PD_SUITE_LIMIT seconds, default 330): a run still going then is stopped as with
#   Ctrl-C. Each run records every test as it ends (tests/suite_log.py) in FSM_PD_SUITE_OUT (default a new folder
#   /tmp/fsm-pd-suite.*): chip.jsonl and cpu.jsonl, beside pytest's own output chip.log and cpu.log. Whatever ends the
#   run (all done, the limit, SIGINT or SIGTERM from outside), it ends with the summary read from those records: the
#   counts, every failure with its message, the tests still running when it was cut, the 15 slowest tests; also
#   written there as summary.md and summary.json.
# - Each test's record holds the programs its process compiled while it ran, by name (FSM_PD_SUITE_COMPILES, default
#   `names`; tests/suite_compiles.py): on the chip most of a test's time is compiling. compiles.txt there has them
#   per file, and the tests that compiled most (`python3 tests/suite_compiles.py chip.jsonl`).
# - Such a host may allow no TCP socket, not even on loopback. The in-process PD engines then serve over unix sockets
#   (tests/node_sockets.py); the tests that need TCP skip with their reason, counted as the real part tcp-loopback
#   ("real parts: tcp-loopback ran N, skipped M" in each run's log; tests/real_parts.py).
# - FSM_PD_SUITE_PATHS: what both runs look in (default "tests/unit tests/property"). The chip's run collects only the
#   files that name the `chip` mark (grep): importing the whole suite cost it about 20 s, with the CPU workers importing
#   it too.
# - Exit status 0 only when every test passed or skipped and both runs finished (a run that collected nothing, under
#   -k, is fine where the other ran tests).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

limit="${FSM_PD_SUITE_LIMIT:-330}"
workers="${FSM_PD_SUITE_WORKERS:-8}"
cpu_nice="${FSM_PD_SUITE_CPU_NICE:-10}"
read -ra paths <<<"${FSM_PD_SUITE_PATHS:-tests/unit tests/property}"
mapfile -t chip_files < <(grep -rl --include='test_*.py' 'mark\.chip' "${paths[@]}" 2>/dev/null | sort)
(( ${#chip_files[@]} )) || chip_files=("${paths[@]}")  # none: the run collects what the CPU's does, and selects none
out="${FSM_PD_SUITE_OUT:-$(mktemp -d /tmp/fsm-pd-suite.XXXXXX)}"
mkdir -p "$out"
rm -f "$out"/chip.jsonl "$out"/cpu.jsonl
export FSM_PD_SUITE_COMPILES="${FSM_PD_SUITE_COMPILES:-names}"
# the chip's process opens it with the host buffer a node asks for (fsm_pd/runtime/tpu_host_buffer.py): libtpu's
# default of 4 GiB took 5 s of the open
export TPU_PREMAPPED_BUFFER_SIZE="${TPU_PREMAPPED_BUFFER_SIZE:-$(python3 -c 'from fsm_pd.runtime.tpu_host_buffer import DEFAULT_BYTES; print(DEFAULT_BYTES)')}"
export FSM_PD_SUITE_COMPILE_CACHE="${FSM_PD_SUITE_COMPILE_CACHE:-${FSM_PD_COMPILE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fsm-pd/jax}}"

# pyproject's addopts name pytest-xdist's --dist options, which pytest refuses where xdist is not installed (a TPU
# host's own Python may lack it): keep the rest of them then, and run the CPU tests in one process.
common=(-q -p no:cacheprovider)
spread=(-n "$workers")
if ! python3 -c "import xdist" 2>/dev/null; then
    common+=(-o "addopts=-ra --strict-markers")
    spread=()
fi

SECONDS=0
FSM_PD_SUITE_LOG="$out/chip.jsonl" timeout -s INT -k 20 "$limit" \
    python3 -m pytest "${common[@]}" "$@" -m chip "${chip_files[@]}" >"$out/chip.log" 2>&1 &
chip=$!
JAX_PLATFORMS=cpu FSM_PD_SUITE_LOG="$out/cpu.jsonl" timeout -s INT -k 20 "$limit" nice -n "$cpu_nice" \
    python3 -m pytest "${common[@]}" "${spread[@]}" "$@" -m "not chip" "${paths[@]}" >"$out/cpu.log" 2>&1 &
cpu=$!
chip_status="" cpu_status=""

finish() {
    trap - INT TERM
    for pid in $chip $cpu; do kill -INT "$pid" 2>/dev/null; done  # timeout passes it on: pytest prints its summary
    for _ in $(seq 30); do
        kill -0 "$chip" 2>/dev/null || kill -0 "$cpu" 2>/dev/null || break
        sleep 1
    done
    for pid in $chip $cpu; do kill -KILL "$pid" 2>/dev/null; done
    summarize
    exit 1
}
trap finish INT TERM

done_in() { local n; n=$(grep -c '"event": "result"' "$1" 2>/dev/null); echo "${n:-0}"; }

summarize() {
    echo "tests/on_tpu.sh: $SECONDS s; the runs' output: $out/chip.log, $out/cpu.log"
    grep -h "^jax: \|^real parts: " "$out/chip.log" "$out/cpu.log" 2>/dev/null | sed 's/^/  /'
    python3 tests/suite_compiles.py "$out/chip.jsonl" "$out/cpu.jsonl" --tests 30 >"$out/compiles.txt" 2>&1
    python3 tests/suite_log.py "$out/chip.jsonl" "$out/cpu.jsonl" --markdown "$out/summary.md" \
        --json "$out/summary.json"
}

where="${workers} CPU workers"
(( ${#spread[@]} )) || where="one CPU process (no pytest-xdist)"
echo "tests/on_tpu.sh: chip tests in one process (pid $chip), the others on $where (pid $cpu); limit ${limit} s;" \
     "records in $out"
last=0
while kill -0 "$chip" 2>/dev/null || kill -0 "$cpu" 2>/dev/null; do
    sleep 2
    if (( SECONDS - last >= 30 )); then
        last=$SECONDS
        echo "tests/on_tpu.sh: ${SECONDS} s: chip $(done_in "$out/chip.jsonl") tests done, cpu $(done_in "$out/cpu.jsonl")"
    fi
done
wait "$chip"; chip_status=$?
wait "$cpu"; cpu_status=$?

summarize
summary_status=$?
echo "tests/on_tpu.sh: pytest exit status chip ${chip_status}, cpu ${cpu_status}"
if (( summary_status != 0 )); then
    exit 1
fi
for status in "$chip_status" "$cpu_status"; do
    if (( status != 0 && status != 5 )); then
        exit "$status"
    fi
done
exit 0
