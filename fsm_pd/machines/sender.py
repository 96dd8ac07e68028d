"""The prefill-side (sender) transfer machine: one literal table, the only source of truth.

Theory of operation
-------------------
A room is created when the prefill node accepts a request carrying a ``bootstrap_room`` (``create``). Two things
must happen before the KV can move: the decode node's PREPARE arrives (``metadata_received``: who to talk to and
its KV layout), and our own prefill finishes (``kv_ready``). They race; whichever comes second starts the transfer:
the sender gathers the request's pages into a staging buffer and publishes it (``GatherAndPublish``), and when that
is done (``published``) sends READY. The decode node pulls, scatters and answers PULLED (``pull_done``), and only
then is the staging buffer released. A prompt prefilled in chunks may send ``kv_ready`` after its first chunk and
``kv_chunk`` after each later one: each publishes the pieces of the prompt that became final, the last one the first
token too (``fsm_pd/effects/chunked.py``), so the chunks are data-plane progress within Transferring.

Rules
-----
- Every non-terminal state has exactly one deadline timer (``DEADLINES``), armed on entry and cancelled on exit;
  ``timeout`` is accepted only while that timer is armed. So every room ends, whatever the peer does. A self-loop
  that is progress (``kv_chunk``) restarts it: cancels and arms it again.
- ``abort`` (local), ``peer_abort`` (ABORT from the decode node), ``timeout`` and ``error`` lead to Failed from
  every non-terminal state. We tell the peer (ABORT) whenever we know it and it did not tell us first.
- ``peer_failed`` (the decode node we know died or was replaced: ``fsm_pd.control.peers``) leads to Failed from the
  states where we know it, with nobody left to tell.
- The staging buffer exists only in Transferring, so exactly the exits from Transferring release it.
- Success and Failed are terminal and sticky: a late or duplicate event is journaled as ignored, never applied.
- Rows are tried in order; the first whose conditions hold (and whose ``unless`` do not) wins.

The ``transitions.Machine``, the diagrams in ``docs/state-machines.md``, the replay and the property tests are all
derived from ``SENDER_TRANSITIONS``; ``fsm_pd.machines.graph`` checks it when this package is imported.
"""

from __future__ import annotations

from fsm_pd.machines.effect_types import ArmTimer, CancelTimer, GatherAndPublish, ReleaseStaging, Send

ROLE = "prefill"

DEADLINES = {
    "Bootstrapping": "bootstrap",  # no PREPARE from the decode node (SGLang's bootstrap timeout)
    "WaitingForInput": "waiting",  # our own prefill has not finished
    "Transferring": "pull_hold",  # published but never PULLED: free the staging buffer
}

SENDER_TRANSITIONS = [
    # --- creation and the PREPARE / prefill race ---
    {"trigger": "create", "source": "Bootstrapping", "dest": "Bootstrapping",
     "conditions": ["is_new"], "effects": (ArmTimer("bootstrap"),)},
    {"trigger": "kv_ready", "source": "Bootstrapping", "dest": "Bootstrapping", "effects": ()},
    {"trigger": "metadata_received", "source": "Bootstrapping", "dest": "Failed",
     "unless": ["layout_matches"], "reason": "layout mismatch",
     "effects": (CancelTimer("bootstrap"), Send("ABORT"))},
    {"trigger": "metadata_received", "source": "Bootstrapping", "dest": "Transferring",
     "conditions": ["kv_ready_seen"],
     "effects": (CancelTimer("bootstrap"), ArmTimer("pull_hold"), GatherAndPublish())},
    {"trigger": "metadata_received", "source": "Bootstrapping", "dest": "WaitingForInput",
     "effects": (CancelTimer("bootstrap"), ArmTimer("waiting"))},
    {"trigger": "kv_ready", "source": "WaitingForInput", "dest": "Transferring",
     "effects": (CancelTimer("waiting"), ArmTimer("pull_hold"), GatherAndPublish())},
    # --- the transfer ---
    {"trigger": "published", "source": "Transferring", "dest": "Transferring", "effects": (Send("READY"),)},
    # chunked prefill announced the transfer after its first chunk (kv_ready); each later chunk's KV is final here,
    # and its pages go out while the next chunk computes (effects/chunked.py): data-plane progress, no new state.
    # Progress restarts the pull_hold deadline: it bounds the wait since the last chunk, not the whole prompt's
    # compute (a 7,400-token prompt failed at exactly 60 s while its later chunks were still computing)
    {"trigger": "kv_chunk", "source": "Transferring", "dest": "Transferring",
     "effects": (CancelTimer("pull_hold"), ArmTimer("pull_hold"), GatherAndPublish())},
    {"trigger": "pull_done", "source": "Transferring", "dest": "Success",
     "conditions": ["published_seen"], "effects": (CancelTimer("pull_hold"), ReleaseStaging())},
    # --- failures from Bootstrapping: the peer is not known yet ---
    {"trigger": "abort", "source": "Bootstrapping", "dest": "Failed", "effects": (CancelTimer("bootstrap"),)},
    {"trigger": "peer_abort", "source": "Bootstrapping", "dest": "Failed", "effects": (CancelTimer("bootstrap"),)},
    {"trigger": "timeout", "source": "Bootstrapping", "dest": "Failed",
     "conditions": ["timer_armed"], "effects": (CancelTimer("bootstrap"),)},
    {"trigger": "error", "source": "Bootstrapping", "dest": "Failed", "effects": (CancelTimer("bootstrap"),)},
    # --- failures from WaitingForInput: tell the peer ---
    {"trigger": "abort", "source": "WaitingForInput", "dest": "Failed",
     "effects": (CancelTimer("waiting"), Send("ABORT"))},
    {"trigger": "peer_abort", "source": "WaitingForInput", "dest": "Failed", "effects": (CancelTimer("waiting"),)},
    {"trigger": "peer_failed", "source": "WaitingForInput", "dest": "Failed", "effects": (CancelTimer("waiting"),)},
    {"trigger": "timeout", "source": "WaitingForInput", "dest": "Failed",
     "conditions": ["timer_armed"], "effects": (CancelTimer("waiting"), Send("ABORT"))},
    {"trigger": "error", "source": "WaitingForInput", "dest": "Failed",
     "effects": (CancelTimer("waiting"), Send("ABORT"))},
    # --- failures from Transferring: tell the peer and release the staging buffer ---
    {"trigger": "abort", "source": "Transferring", "dest": "Failed",
     "effects": (CancelTimer("pull_hold"), Send("ABORT"), ReleaseStaging())},
    {"trigger": "peer_abort", "source": "Transferring", "dest": "Failed",
     "effects": (CancelTimer("pull_hold"), ReleaseStaging())},
    {"trigger": "peer_failed", "source": "Transferring", "dest": "Failed",
     "effects": (CancelTimer("pull_hold"), ReleaseStaging())},
    {"trigger": "timeout", "source": "Transferring", "dest": "Failed",
     "conditions": ["timer_armed"], "effects": (CancelTimer("pull_hold"), Send("ABORT"), ReleaseStaging())},
    {"trigger": "error", "source": "Transferring", "dest": "Failed",
     "effects": (CancelTimer("pull_hold"), Send("ABORT"), ReleaseStaging())},
]
