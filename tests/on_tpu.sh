#!/usr/bin/env bash
# The unit and property tests on a TPU host, on the chip: `bash tests/on_tpu.sh` from the repo root (README, "On a
# TPU host"). Extra arguments go to pytest (`bash tests/on_tpu.sh -x`, `-k kernels`). CI does not run this.
#
# - One process, no -n: one process at a time can open the chip, so pytest-xdist workers could not share it. This
#   process takes it before any test runs; the processes tests start (nodes, the mesh checks) run jax on the CPU
#   (tests/on_chip.py). The last lines say where jax ran.
# - Such a host may allow no TCP socket, not even on loopback. The in-process PD engines then serve over unix sockets
#   (tests/node_sockets.py); the tests that need TCP skip with their reason, counted as the real part tcp-loopback
#   ("real parts: tcp-loopback ran N, skipped M"; tests/real_parts.py).
# - It ends with the run's time, and exits with pytest's status: 0 only when every test passed or skipped, and 5
#   (no tests collected) is a failure like any other non-zero status.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# pyproject's addopts name pytest-xdist's --dist options, which pytest refuses where xdist is not installed (a TPU
# host's own Python may lack it): keep the rest of them then.
extra=()
python3 -c "import xdist" 2>/dev/null || extra=(-o "addopts=-ra --strict-markers")

SECONDS=0
python3 -m pytest -q -p no:cacheprovider "${extra[@]}" "$@" tests/unit tests/property
status=$?
echo "tests/on_tpu.sh: tests/unit and tests/property took ${SECONDS} s; pytest exit status ${status}"
exit "$status"
