"""How long each room spent in each phase of its transfer, and why a failed one failed, in a few fixed classes.

Both come from the machines' own transitions as the node loop journals them (an observer's ``(room, decision,
at)``, ``at`` being the event's journaled time), never from a clock read elsewhere: the figures in ``/metrics``, in
a response's ``meta_info`` and in ``fsm-pd replay``'s "time in states" are the same numbers.

Phases are the non-terminal states: ``bootstrap`` (Bootstrapping: finding the peer; on decode also reserving
pages), ``waiting`` (WaitingForInput: decode waits for READY, prefill for its own prefill) and ``transfer``
(Transferring: gather, publish, pull, scatter). A prefill room whose prompt finished before PREPARE came skips
WaitingForInput; it spent 0 s there.
"""

from __future__ import annotations

from collections import OrderedDict

PHASES = {"Bootstrapping": "bootstrap", "WaitingForInput": "waiting", "Transferring": "transfer"}
PHASE_NAMES = tuple(PHASES.values())

# Why a room failed, in a label set small and fixed enough for Prometheus (the full reason stays in the journal,
# the log line and ``fsm_pd_failures_total``). Derived from the machines' failure triggers (``failure_reason``) and
# the reasons the control plane's handlers give their ``error`` events.
REASON_CLASSES = (
    "timeout",  # a state's deadline passed (``bootstrap timeout``...), or an effect timed out (blame ``timeout``)
    "peer_failed",  # the peer process died, stopped answering heartbeats, or restarted
    "peer_aborted",  # the peer gave up first and told us (ABORT)
    "aborted",  # a local abort: the client went away, /abort_request
    "layout_mismatch",  # the peer's KV layout was refused
    "bootstrap_error",  # the bootstrap server could not tell the decode node where the prefill node is
    "transfer_error",  # gather, publish, pull or scatter failed
    "kv_checksum_mismatch",  # the KV in the decode node's pages is not what the prefill node sent (checksums.py)
    "side_channel_error",  # a control message could not be sent (peer unreachable)
    "node_restarted",  # this node restarted and failed the rooms its journal showed unfinished
    "error",  # any other effect failure (the prefill forward pass, admission)
)
_ERROR_CLASSES = (  # the detail of an ``error`` event, after its "<blame> error: " head
    ("node restarted", "node_restarted"),
    ("bootstrap lookup failed", "bootstrap_error"),
    ("pull failed", "transfer_error"),
    ("scatter failed", "transfer_error"),
    ("kv checksum mismatch", "kv_checksum_mismatch"),
    ("gather/publish failed", "transfer_error"),
    ("side channel", "side_channel_error"),
    ("sending ", "side_channel_error"),
)


def reason_class(trigger: str, reason: str | None) -> str:
    """The class of a Failed decision, from its trigger and its reason (``Decision.reason``)."""
    if trigger == "timeout":
        return "timeout"
    if trigger == "peer_failed":
        return "peer_failed"
    if trigger == "peer_abort":
        return "peer_aborted"
    if trigger == "abort":
        return "aborted"
    reason = reason or ""
    if reason == "layout mismatch":
        return "layout_mismatch"
    blame, _, detail = reason.partition(" error: ")
    if blame == "timeout":
        return "timeout"
    for head, name in _ERROR_CLASSES:
        if detail.startswith(head):
            return name
    if " unreachable: " in detail:  # the outbox's "<peer> unreachable: ..."
        return "side_channel_error"
    return "error"


class PhaseClock:
    """Seconds per phase of each open room, from the decisions the node loop journals (an observer).

    When a room ends, ``observe`` returns its seconds per phase, and keeps them for ``take`` (the engine that
    answers the request reads them once, from its own observer, later in the same step). Only the last ``keep``
    ended rooms are kept: a reader that never comes does not grow memory.
    """

    def __init__(self, keep: int = 4096):
        self.keep = keep
        self._open: dict[int, tuple[str, float, dict[str, float]]] = {}  # room -> (state, entered at, seconds)
        self._ended: OrderedDict[int, dict[str, float]] = OrderedDict()

    def observe(self, room, decision, at: float) -> dict[str, float] | None:
        """Account one decision; the room's seconds per phase when this decision ended it, else None."""
        if decision.ignored is not None:
            return None
        if decision.trigger == "create" and decision.version == 0:
            self._open[room.room] = (decision.dst, at, dict.fromkeys(PHASE_NAMES, 0.0))
            return None
        if decision.src == decision.dst:
            return None
        found = self._open.get(room.room)
        if found is None:  # rebuilt from the journal after a restart: its entry times were not seen
            return None
        state, entered, seconds = found
        if state in PHASES:
            seconds[PHASES[state]] += max(0.0, at - entered)
        if decision.dst in PHASES:
            self._open[room.room] = (decision.dst, at, seconds)
            return None
        del self._open[room.room]
        self._ended[room.room] = seconds
        while len(self._ended) > self.keep:
            self._ended.popitem(last=False)
        return seconds

    def take(self, room: int) -> dict[str, float] | None:
        """The seconds per phase of a room that ended (once; None if unknown or already taken)."""
        return self._ended.pop(room, None)


def timing_meta(seconds: dict[str, float] | None) -> dict[str, float]:
    """A room's phases as ``meta_info`` fields, named as SGLang's request time stats name them."""
    if not seconds:
        return {}
    return {f"{phase}_duration": round(seconds[phase], 6) for phase in PHASE_NAMES}
