"""What each state's deadline waits for, in words, and where an operator sets it: the explanation a client's error
and ``fsm-pd replay`` give when a room's timer ended it, and the help of ``fsm-pd serve``'s deadline flags (through
``fsm_pd.control.config``: this is the one place these words live).

The timers themselves are the tables' (``DEADLINES`` and ``HANDOVERS`` in ``sender.py`` and ``receiver.py``); their
lengths are recorded in each room's ``create`` event (``deadlines``), so a journal explains itself without the node's
flags. The environment variables are ``fsm_pd.control.config.ENV``'s and the flags ``fsm-pd serve``'s
(``tests/unit/test_deadline_explain.py`` holds the three together).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StateDeadline:
    role: str
    timer: str
    state: str
    waits_for: str  # what the room waits for in that state, as a clause after "waited for"

    @property
    def env(self) -> str:
        return f"FSM_PD_{self.timer.upper()}_TIMEOUT"

    @property
    def flag(self) -> str:
        return f"--{self.timer.replace('_', '-')}-timeout"


STATE_DEADLINES = {(d.role, d.timer): d for d in (
    StateDeadline("prefill", "bootstrap", "Bootstrapping",
                  "the decode node's PREPARE (where to send the KV; it comes once the decode node has found this node "
                  "and has pages for the prompt)"),
    StateDeadline("prefill", "waiting", "WaitingForInput", "its own prefill of the prompt to finish"),
    StateDeadline("prefill", "pull_hold", "Transferring",
                  "the decode node to pull the published KV and say PULLED"),
    StateDeadline("decode", "bootstrap", "Bootstrapping", "the prefill node's address from its bootstrap server"),
    StateDeadline("decode", "admission", "Bootstrapping",
                  "free KV pages for the prompt (its place in the pre-allocation queue, the prefill node's address "
                  "known)"),
    StateDeadline("decode", "waiting", "WaitingForInput",
                  "the prefill node's READY (its prefill done and the KV published)"),
    StateDeadline("decode", "transfer", "Transferring", "the KV to be pulled, checked and scattered"),
)}


def state_deadline(role: str, timer: str) -> StateDeadline | None:
    return STATE_DEADLINES.get((role, timer))


def explain_timeout(role: str, timer: str, seconds: float | None) -> str:
    """One sentence: which deadline passed, in which state, what the room waited for, how long it was, who sets it."""
    known = state_deadline(role, timer)
    length = f" {seconds:g} s" if seconds is not None else ""
    if known is None:
        return f"the {timer} deadline{length and ' of' + length} passed"
    return (f"the {role} node waited{length} in {known.state} for {known.waits_for}: its {timer} deadline "
            f"({known.flag} / ${known.env})")


def ended_by_deadline(reason: str | None) -> bool:
    """Whether a room's failure reason (plain or explained) says one of its state deadlines ended it."""
    return reason is not None and any(reason.startswith(f"{timer} timeout") for _, timer in STATE_DEADLINES)


PEER = {"prefill": "decode", "decode": "prefill"}
PEER_ABORT = "aborted by peer: "


def explain_failure(role: str, reason: str | None, deadlines: Mapping[str, float] | None) -> str | None:
    """A room's failure reason, with the deadline explained when its timer ended it (``failure_reason`` writes
    ``"<timer> timeout"``) or the peer's timer did (``"aborted by peer: <timer> timeout"``: its length is the
    peer's, not recorded here); any other reason as it is."""
    if reason is None:
        return None
    timer = reason.split(" timeout", 1)[0] if " timeout" in reason else None
    if timer is not None and state_deadline(role, timer) is not None and reason.startswith(f"{timer} timeout"):
        seconds = (deadlines or {}).get(timer)
        return f"{reason}: {explain_timeout(role, timer, float(seconds) if seconds is not None else None)}"
    peer = PEER.get(role)
    if timer is not None and timer.startswith(PEER_ABORT) and peer is not None:
        timer = timer[len(PEER_ABORT):]
        if state_deadline(peer, timer) is not None:
            return f"{reason}: {explain_timeout(peer, timer, None)}"
    return reason
