"""Prometheus metrics of one node, fed by the node loop's observers (after each decision is journaled), and the log
line of each failed room (``failure_log.py``).

Each manager has its own ``CollectorRegistry`` so that several nodes can live in one process (tests, ``launch``);
the HTTP layer serves ``generate_latest(metrics.registry)`` on ``/metrics``.

The observer runs on the thread that decides the rooms, inside the step: under ``--role pd`` that is a handoff's own
path on the model thread, where each Prometheus update takes a lock and a successful room's end made eight of them
(a sixth of a handoff's Python, cProfile). So it keeps only what must be known in the step (each room's phases, which
the engine reads as the room ends, and a failure's log line and counters) and queues the rest, which ``settle``
applies: at the loop's commit or idle wake (``KVManager.commit``, ``keep_alive``), before any read of the registry
(a collector registered ahead of the metrics), and whenever the queue grows long. A scrape sees every decision made
before it, as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from fsm_pd.control.failure_log import log_failed_room
from fsm_pd.control.phases import PHASE_NAMES, REASON_CLASSES, PhaseClock, reason_class
from fsm_pd.effects.checksums import OUTCOMES as CHECKSUM_OUTCOMES
from fsm_pd.machines.states import STATE_NAMES

OWED_LIMIT = 4096  # decisions whose updates wait for ``settle``, at most: a node nobody scrapes keeps no backlog
# seconds from the transfer's start to its end, on each side: P published -> PULLED, D READY -> scattered
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 36, 2))  # 1 KiB .. 32 GiB
TRANSFER_START = {"prefill": "published", "decode": "kv_published"}
# leak counters exported as gauges (``NodeMetrics.watch_leaks``): key of the engine's counters -> (metric, help)
LEAK_GAUGES = {
    "pages_free": ("fsm_pd_kv_pages_free", "KV pages free in this node's pool"),
    "pages_reserved": ("fsm_pd_kv_pages_reserved", "KV pages reserved by requests and transfers"),
    "staging_buffers_held": ("fsm_pd_staging_buffers_held", "Gathered KV staging buffers held (prefill)"),
    "pulled_awaiting_scatter": ("fsm_pd_pulled_awaiting_scatter", "Pulled KV buffers not yet scattered (decode)"),
    "open_transfer_entries": ("fsm_pd_open_transfer_entries", "Transfer-backend entries still pinning memory"),
    "rooms_open": ("fsm_pd_rooms_open", "Rooms not yet Success or Failed"),
    "requests_live": ("fsm_pd_requests_live", "Requests the engine is serving"),
    "queued": ("fsm_pd_requests_queued", "Requests not yet answered (prefill) or not yet decoding (decode)"),
    "requests_running": ("fsm_pd_requests_running", "Requests in the decode batch"),
}


class NodeMetrics:
    def __init__(self, node, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self._owed: deque[tuple] = deque()  # (trigger, dst, detail, ended) per decision, for ``settle``
        self.registry.register(_Settling(self))  # ahead of the metrics: every read of the registry settles first
        role = self.role = node.role
        labels = {"role": role, "node": node.node_id}
        self.rooms = Gauge("fsm_pd_rooms", "Rooms by state", ["role", "node", "state"], registry=self.registry)
        self.transitions = Counter("fsm_pd_transitions", "Journaled events by trigger and outcome",
                                   ["role", "node", "trigger", "dst"], registry=self.registry)
        self.ignored = Counter("fsm_pd_ignored_events", "Events that changed nothing (late, duplicate, illegal)",
                               ["role", "node", "trigger"], registry=self.registry)
        self.failures = Counter("fsm_pd_failures", "Rooms that ended Failed, by reason",
                                ["role", "node", "reason"], registry=self.registry)
        self.transfer_seconds = Histogram("fsm_pd_transfer_seconds", "Transfer latency on this side",
                                          ["role", "node"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.transfer_bytes = Histogram("fsm_pd_transfer_bytes", "Bytes per pulled KV transfer",
                                        ["role", "node"], buckets=BYTES_BUCKETS, registry=self.registry)
        # per phase of each successful transfer, timed by the machine's own transitions (``phases.py``)
        self.phase_seconds = Histogram("fsm_pd_transfer_phase_seconds",
                                       "Seconds a successful transfer spent in each phase on this side",
                                       ["role", "node", "phase"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ended = Counter("fsm_pd_transfers_ended", "Transfers that ended, by outcome and class of failure reason",
                             ["role", "node", "outcome", "reason"], registry=self.registry)
        # the KV checksum of each handoff, as the decode node's scattered or failed rooms journaled it
        self.checksums = Counter("fsm_pd_kv_checksums", "KV checksums of handoffs on this decode node, by outcome: "
                                 "verified, mismatch (the room failed), missing (the prefill node sent none), "
                                 "unchecked (a pool on an accelerator), off (--kv-checksum off)",
                                 ["role", "node", "outcome"], registry=self.registry)
        self.adopted = Counter("fsm_pd_pages_adopted", "KV pages a decode engine adopted from the prefill engine's "
                               "rooms in a pool both share (--role pd, backend pool): handed over, no byte copied",
                               ["role", "node"], registry=self.registry)
        self.backend = Gauge("fsm_pd_transfer_backend", "1 for the transfer backend this node moves KV with",
                             ["role", "node", "backend"], registry=self.registry)
        self.phases = PhaseClock()
        self._node = node
        self._labels = labels
        # The observer runs on the node loop for every event: labelled children are looked up once and kept (a
        # ``labels()`` call costs more than the rest of the observer). Every phase and outcome series exists from
        # the first scrape (at 0), so rates and dashboards work before the first failure.
        self._phase = {phase: self.phase_seconds.labels(role, node.node_id, phase) for phase in PHASE_NAMES}
        self._success = self.ended.labels(role, node.node_id, "success", "none")
        self._failed = {name: self.ended.labels(role, node.node_id, "failed", name) for name in REASON_CLASSES}
        self._transfer_seconds = self.transfer_seconds.labels(role, node.node_id)
        self._transfer_bytes = self.transfer_bytes.labels(role, node.node_id)
        self._adopted = self.adopted.labels(role, node.node_id)
        self._checksum = ({outcome: self.checksums.labels(role, node.node_id, outcome)
                           for outcome in (*CHECKSUM_OUTCOMES, "mismatch")} if role == "decode" else {})
        self._children: dict[tuple, object] = {}  # (metric, label values...) -> child, for the open label sets
        for state in STATE_NAMES:  # counted at scrape time from the journaled states, so cleared rooms drop out
            self.rooms.labels(state=state, **labels).set_function(
                lambda s=state: sum(1 for v in list(node.states.values()) if v == s))
        self._started: dict[int, float] = {}
        node.observers.append(self.observe)

    def watch_leaks(self, source: Callable[[], Mapping[str, float | int | None]]) -> None:
        """Export ``source()`` (an engine's ``leak_counters``) as gauges, read once per scrape."""
        self.registry.register(_LeakCollector(source, self._labels))

    def _child(self, metric, *values: str):
        key = (metric, *values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(self.role, self._node.node_id, *values)
        return found

    def observe(self, room, decision, at: float) -> None:
        seconds = self.phases.observe(room, decision, at)
        trigger = decision.trigger
        if decision.ignored is not None:
            self._owe(trigger, None, None, None)
            return
        if trigger == TRANSFER_START[self.role]:
            self._started[room.room] = at
        detail = ended = None
        if trigger == "pulled":
            detail = float(room.ctx.get("bytes", 0))
        elif trigger == "scattered":  # read now: the room's context changes with its later events
            detail = (room.ctx.get("kv_checksum_check"), room.ctx.get("adopted_pages"))
        if decision.dst in ("Success", "Failed") and decision.src != decision.dst:
            started = self._started.pop(room.room, None)
            if decision.dst == "Success":
                ended = (None if started is None else max(0.0, at - started), seconds)
            else:
                self._child(self.failures, _reason_label(decision.reason)).inc()
                cls = reason_class(trigger, decision.reason)
                self._failed[cls].inc()
                if cls == "kv_checksum_mismatch" and self._checksum:
                    self._checksum["mismatch"].inc()
                log_failed_room(self._node, room, decision, cls)
        self._owe(trigger, decision.dst, detail, ended)

    def _owe(self, *update) -> None:
        self._owed.append(update)
        if len(self._owed) > OWED_LIMIT:
            self.settle()

    def settle(self) -> None:
        """Apply the updates ``observe`` queued (any thread; two at once each take their own)."""
        owed = self._owed
        while owed:
            try:
                trigger, dst, detail, ended = owed.popleft()
            except IndexError:  # another thread took the last one
                return
            if dst is None:
                self._child(self.ignored, trigger).inc()
                continue
            self._child(self.transitions, trigger, dst).inc()
            if trigger == "pulled":
                self._transfer_bytes.observe(detail)
            elif trigger == "scattered":
                check, adopted = detail
                if check in self._checksum:
                    self._checksum[check].inc()
                if adopted:
                    self._adopted.inc(int(adopted))
            if ended is not None:
                transfer_s, seconds = ended
                if transfer_s is not None:
                    self._transfer_seconds.observe(transfer_s)
                for phase, value in (seconds or {}).items():
                    self._phase[phase].observe(value)
                self._success.inc()


class _Settling:
    """Registered ahead of the node's metrics: a read of the registry (a scrape, ``get_sample_value``) first applies
    the updates still queued (``NodeMetrics.settle``), so it sees every decision made before it."""

    def __init__(self, metrics: NodeMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        self.metrics.settle()
        return []


class _LeakCollector:
    def __init__(self, source, labels: Mapping[str, str]):
        self.source, self.labels = source, dict(labels)

    def describe(self):
        return []  # the families depend on the role: nothing to check at registration

    def collect(self):
        values = self.source()
        for key, (name, doc) in LEAK_GAUGES.items():
            if values.get(key) is None:
                continue
            family = GaugeMetricFamily(name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), float(values[key]))
            yield family


def _reason_label(reason: str | None) -> str:
    """Keep label cardinality bounded: the reason up to its first detail (``remote error: pull failed``)."""
    if not reason:
        return "unknown"
    head = reason.split(":", 2)
    return ":".join(head[:2]).strip()[:80]
