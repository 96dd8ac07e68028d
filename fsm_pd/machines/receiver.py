"""The decode-side (receiver) transfer machine: one literal table, the only source of truth.

Theory of operation
-------------------
A room is created when the decode node accepts a request carrying a ``bootstrap_room`` (``create``). It asks the
bootstrap server where the prefill node is (``ResolveBootstrap`` → ``bootstrap_resolved``) and, at the same time,
queues for KV pages for the prompt (``ReservePages`` → ``pages_reserved``: the engine's pre-allocation queue, which
waits while the pool is full). When both are done it sends PREPARE and waits for READY (``kv_published``). READY's
layout is checked against ours; then the staging buffer is pulled and verified on a worker thread (``Pull`` →
``pulled``), written into the reserved pages on the model thread (``Scatter`` → ``scattered``), and PULLED tells the
prefill node to let go.

Bootstrapping waits for two things, one after the other in the worst case, each under its own deadline: the
``bootstrap`` deadline until the prefill node's address is known, then, if the pages have not come yet, the
``admission`` deadline while the room waits only for pages (``HANDOVERS``). A request queued behind memory
pressure is thus never failed as if its prefill node could not be found, and the one that waited too long says so
("admission timeout": it waited for free KV pages). SGLang likewise keeps its pre-allocation queue apart from its
bootstrap timeout.

Rules
-----
- Every non-terminal state has exactly one deadline timer armed at any moment: the one of ``DEADLINES``, armed on
  entry, or in Bootstrapping the one it hands over to; every exit cancels the one armed. Each row from Bootstrapping
  says by a guard (``bootstrap_resolved_seen``) which of the two it runs under. A self-loop that is progress
  (``piece_pulled``: a piece of a chunked handoff landed) restarts its state's timer.
- ``abort``, ``peer_abort``, ``peer_failed`` (the prefill node's heartbeat stopped), ``timeout`` and ``error``
  lead to Failed from every non-terminal state, and every one of those exits frees the reserved pages; success
  keeps them (the request decodes from them). We tell the prefill node (ABORT) whenever we know where it is and it
  did not tell us first: from the moment its address is known, since it waits for our PREPARE.
- Nothing pulled is scattered before it is verified: ``Scatter`` is only ever asked for by ``pulled``, which the
  pull handler emits only for a ready, error-free, layout-checked buffer.
- Success and Failed are terminal and sticky: late or duplicate events are journaled as ignored.
"""

from __future__ import annotations

from fsm_pd.machines.effect_types import (
    ArmTimer,
    CancelTimer,
    FreePages,
    Pull,
    ReservePages,
    ResolveBootstrap,
    Scatter,
    Send,
)

ROLE = "decode"

# The detail of the ``error`` that fails a room whose KV, as written into our pages, does not match the checksum the
# prefill node computed when it was final (``effects/checksums.py``): "remote error: kv checksum mismatch: piece 0
# layer 5: ...". The wire, the prefill node's pages (freed and reused while they were sent) or our own pool changed
# the bytes; the decode engine recomputes the request as for any failed transfer.
KV_CHECKSUM_MISMATCH = "kv checksum mismatch"

DEADLINES = {
    "Bootstrapping": "bootstrap",  # the prefill node's address not found in time
    "WaitingForInput": "waiting",  # PREPARE sent, no READY (SGLang's waiting timeout)
    "Transferring": "transfer",  # READY seen, the pull is not verified and scattered in time
}
# the address known, no pages yet: from then on the room waits only for free pages, under admission's deadline
HANDOVERS = {"Bootstrapping": ("bootstrap_resolved", "admission")}

RECEIVER_TRANSITIONS = [
    # --- creation: find the prefill node and queue for pages, in either order ---
    {"trigger": "create", "source": "Bootstrapping", "dest": "Bootstrapping",
     "conditions": ["is_new"], "effects": (ArmTimer("bootstrap"), ResolveBootstrap(), ReservePages())},
    {"trigger": "bootstrap_resolved", "source": "Bootstrapping", "dest": "WaitingForInput",
     "conditions": ["pages_reserved_seen"], "unless": ["bootstrap_resolved_seen"],
     "effects": (CancelTimer("bootstrap"), ArmTimer("waiting"), Send("PREPARE"))},
    {"trigger": "bootstrap_resolved", "source": "Bootstrapping", "dest": "Bootstrapping",
     "unless": ["bootstrap_resolved_seen"], "effects": (CancelTimer("bootstrap"), ArmTimer("admission"))},
    {"trigger": "pages_reserved", "source": "Bootstrapping", "dest": "WaitingForInput",
     "conditions": ["bootstrap_resolved_seen"],
     "effects": (CancelTimer("admission"), ArmTimer("waiting"), Send("PREPARE"))},
    {"trigger": "pages_reserved", "source": "Bootstrapping", "dest": "Bootstrapping", "effects": ()},
    # --- READY: check the layout, then pull, verify, scatter ---
    {"trigger": "kv_published", "source": "WaitingForInput", "dest": "Failed",
     "unless": ["layout_matches"], "reason": "layout mismatch",
     "effects": (CancelTimer("waiting"), Send("ABORT"), FreePages())},
    {"trigger": "kv_published", "source": "WaitingForInput", "dest": "Transferring",
     "effects": (CancelTimer("waiting"), ArmTimer("transfer"), Pull())},
    # a chunked handoff's piece landed (effects/chunk_pull.py) while the prefill node still computes later ones:
    # progress restarts the transfer deadline, which bounds the wait since the last piece, not the whole prompt
    {"trigger": "piece_pulled", "source": "Transferring", "dest": "Transferring",
     "unless": ["pulled_seen"], "effects": (CancelTimer("transfer"), ArmTimer("transfer"))},
    {"trigger": "pulled", "source": "Transferring", "dest": "Transferring",
     "unless": ["pulled_seen"], "effects": (Scatter(),)},
    {"trigger": "scattered", "source": "Transferring", "dest": "Success",
     "conditions": ["pulled_seen"], "effects": (CancelTimer("transfer"), Send("PULLED"))},
    # --- failures from Bootstrapping, the address unknown: the prefill node does not know us, nor we it ---
    {"trigger": "abort", "source": "Bootstrapping", "dest": "Failed",
     "unless": ["bootstrap_resolved_seen"], "effects": (CancelTimer("bootstrap"), FreePages())},
    {"trigger": "peer_abort", "source": "Bootstrapping", "dest": "Failed",
     "unless": ["bootstrap_resolved_seen"], "effects": (CancelTimer("bootstrap"), FreePages())},
    {"trigger": "peer_failed", "source": "Bootstrapping", "dest": "Failed",
     "unless": ["bootstrap_resolved_seen"], "effects": (CancelTimer("bootstrap"), FreePages())},
    {"trigger": "timeout", "source": "Bootstrapping", "dest": "Failed",
     "conditions": ["timer_armed"], "unless": ["bootstrap_resolved_seen"],
     "effects": (CancelTimer("bootstrap"), FreePages())},
    {"trigger": "error", "source": "Bootstrapping", "dest": "Failed",
     "unless": ["bootstrap_resolved_seen"], "effects": (CancelTimer("bootstrap"), FreePages())},
    # --- failures from Bootstrapping while waiting for pages: the prefill node waits for our PREPARE, tell it ---
    {"trigger": "abort", "source": "Bootstrapping", "dest": "Failed",
     "conditions": ["bootstrap_resolved_seen"], "effects": (CancelTimer("admission"), Send("ABORT"), FreePages())},
    {"trigger": "peer_abort", "source": "Bootstrapping", "dest": "Failed",
     "conditions": ["bootstrap_resolved_seen"], "effects": (CancelTimer("admission"), FreePages())},
    {"trigger": "peer_failed", "source": "Bootstrapping", "dest": "Failed",
     "conditions": ["bootstrap_resolved_seen"], "effects": (CancelTimer("admission"), FreePages())},
    {"trigger": "timeout", "source": "Bootstrapping", "dest": "Failed",
     "conditions": ["timer_armed", "bootstrap_resolved_seen"],
     "effects": (CancelTimer("admission"), Send("ABORT"), FreePages())},
    {"trigger": "error", "source": "Bootstrapping", "dest": "Failed",
     "conditions": ["bootstrap_resolved_seen"], "effects": (CancelTimer("admission"), Send("ABORT"), FreePages())},
    # --- failures from WaitingForInput: tell the prefill node, free the pages ---
    {"trigger": "abort", "source": "WaitingForInput", "dest": "Failed",
     "effects": (CancelTimer("waiting"), Send("ABORT"), FreePages())},
    {"trigger": "peer_abort", "source": "WaitingForInput", "dest": "Failed",
     "effects": (CancelTimer("waiting"), FreePages())},
    {"trigger": "peer_failed", "source": "WaitingForInput", "dest": "Failed",
     "effects": (CancelTimer("waiting"), FreePages())},
    {"trigger": "timeout", "source": "WaitingForInput", "dest": "Failed",
     "conditions": ["timer_armed"], "effects": (CancelTimer("waiting"), Send("ABORT"), FreePages())},
    {"trigger": "error", "source": "WaitingForInput", "dest": "Failed",
     "effects": (CancelTimer("waiting"), Send("ABORT"), FreePages())},
    # --- failures from Transferring: the pull result, if it ever comes, lands on a terminal room and is ignored ---
    {"trigger": "abort", "source": "Transferring", "dest": "Failed",
     "effects": (CancelTimer("transfer"), Send("ABORT"), FreePages())},
    {"trigger": "peer_abort", "source": "Transferring", "dest": "Failed",
     "effects": (CancelTimer("transfer"), FreePages())},
    {"trigger": "peer_failed", "source": "Transferring", "dest": "Failed",
     "effects": (CancelTimer("transfer"), FreePages())},
    {"trigger": "timeout", "source": "Transferring", "dest": "Failed",
     "conditions": ["timer_armed"], "effects": (CancelTimer("transfer"), Send("ABORT"), FreePages())},
    {"trigger": "error", "source": "Transferring", "dest": "Failed",
     "effects": (CancelTimer("transfer"), Send("ABORT"), FreePages())},
]
