"""Where a request's time to its first token goes on this node: ``fsm_pd_request_phase_seconds{role,node,phase}``.

With the transfer phases of ``fsm_pd_transfer_phase_seconds`` (decode: bootstrap, waiting, transfer) they split a
PD request's TTFT into the parts ``bench/pd_fixed_cost.py`` compares with a colocated node's:

- ``queue``: from joining the prefill queue to the request's first chunk (prefill and colocated nodes; a prefill
  node queues a request once its room is bootstrapped);
- ``prefill``: from its first chunk to its last, the first token sampled (prefill and colocated);
- ``admission``: from the end of its transfer to its first token going out (decode);
- ``first_token``: from the request's arrival at this node to its first token: sampled on a prefill node (READY
  goes next), sent on a colocated or decode node.

Observed on the model thread (prefill, colocated) or the thread that emits (decode); a histogram child's
``observe`` is thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from fsm_pd.control.metrics import LATENCY_BUCKETS

REQUEST_PHASES = ("queue", "prefill", "admission", "first_token")


class RequestPhases:
    def __init__(self, registry: CollectorRegistry, role: str, node: str):
        histogram = Histogram("fsm_pd_request_phase_seconds", "Seconds a request spent in each phase before its "
                              "first token on this node (docs/serving.md)", ["role", "node", "phase"],
                              buckets=LATENCY_BUCKETS, registry=registry)
        self._children = {phase: histogram.labels(role, node, phase) for phase in REQUEST_PHASES}

    def observe(self, phase: str, seconds: float) -> None:
        self._children[phase].observe(max(0.0, seconds))
