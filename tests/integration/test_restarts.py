"""Issue 11's "done means" on real processes: 32 concurrent mixed (streamed and whole, /generate and chat) requests
through the built-in router while a node is SIGKILLed and restarted at the same address and ports, or SIGSTOPped past
every deadline (12 s; the drill bench's 20 s proves nothing more and cost 16 s of the suite); and bad input sent beside
ordinary requests. The drills themselves are in ``drills.py``. They share one rig (``shared_rig``, with
``test_faults.py``): each warms it up first, and the killed node's restart is the drill's own.
"""

from __future__ import annotations

import pytest
from drills import bad_input, kill_and_restart, stop_and_continue
from fault_rig import DEADLINE_S, REQUEST_BOUND_S

# The acceptance drills of issue 11: about two minutes together on two idle cores. One xdist worker runs this module
# and test_faults.py, which share their fault rig (conftest.shared_rig).
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("fault-rig")]


def _no_hang(figures: dict) -> None:
    assert figures["hung"] == 0 and figures["silent"] == 0, figures


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_node_killed_and_restarted_under_load(shared_rig, role):
    figures = kill_and_restart(shared_rig(), role)
    print(figures)
    _no_hang(figures)
    assert figures["in_flight_at_kill"] > 0, figures
    # every request the dead node held ended within a request's bound: with an error, or (a prefill killed) answered
    # after the decode node's heartbeats found it dead and it recomputed the request (``peer_failed``), a whole
    # generation on a loaded host (19.7 s once, with two more test runs beside the suite, against 10 s asserted here
    # when they all failed fast)
    assert figures["in_flight_max_end_s"] <= REQUEST_BOUND_S, figures
    # the new instance is used at once: well inside the router's 10 s cooldown of an ejected worker (a router that
    # waited it out could not answer sooner), with room for one request among 32 streams on a loaded 2-core host
    assert figures["health_to_first_success_s"] <= 8, figures


@pytest.mark.slow
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_node_stopped_past_every_deadline_under_load(shared_rig, role):
    stop_s = 3 * DEADLINE_S  # past every deadline a room can meet on either side (bench/fault_drill.py stops 20 s)
    figures = stop_and_continue(shared_rig(), role, seconds=stop_s)
    print(figures)
    _no_hang(figures)
    # Stopped prefill: every request ends by its deadlines (a decode that recomputed does not wait for it), those
    # whose pages the decode node held by then answered from its own prefill (its heartbeats found the prefill
    # dead), the rest with an error. Stopped decode: a stream it was already sending stalls with it, the KV being
    # there, and ends once it runs again.
    bound = REQUEST_BOUND_S if role == "prefill" else stop_s + 8
    assert figures["longest_request_s"] <= bound, figures
    if role == "prefill":
        assert figures["decode_recomputes"] > 0 or figures["overlapping_results"]["error"] > 0, figures
    else:
        assert figures["overlapping_results"]["error"] > 0, figures


def test_bad_input_gets_4xx_and_hurts_nobody(shared_rig):
    figures = bad_input(shared_rig())
    print(figures)
    statuses = figures["statuses"]
    assert figures["error"] == 0 and figures["hung"] == 0 and figures["silent"] == 0, figures
    assert figures["health"] == {"prefill": 200, "decode": 200}, figures
    for role in ("prefill", "decode"):
        assert statuses[f"{role}: the same room again"] == [409], statuses
        assert statuses[f"{role}: room 2**63"] == [400], statuses
    for name, codes in statuses.items():
        if "first use" not in name:
            assert all(400 <= c < 500 for c in codes), (name, codes)
