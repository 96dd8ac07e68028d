"""What every engine needs besides its scheduler: request checks, the context limit, the journal's path and
``/flush_cache``. The table of live requests that ``abort`` works through is ``request_table.py``."""

from __future__ import annotations

import tempfile
from pathlib import Path

from fsm_pd.machines import KVPoll
from fsm_pd.machines.deadlines import ended_by_deadline
from fsm_pd.model.loader import LoadedModel
from fsm_pd.serving import top_logprobs
from fsm_pd.serving.types import EngineError, GenerateRequest
from fsm_pd.store.limits import MAX_ROOM

ENDED = (KVPoll.Success, KVPoll.Failed)  # a room in either state changes no more
UNAVAILABLE_STATUS = 503  # the node cannot serve at all (its loop stopped, its model thread died)
ROOM_IN_USE_STATUS = 409  # a conflict with this node's state (the room's earlier request), not a malformed request
PEER_FAILED_STATUS = 502  # the peer node failed the transfer: this node is fine, the one it depended on was not
# the machines' failure reasons (``failure_reason``) that blame the peer: it died, restarted or went silent (its
# heartbeats), it aborted the room, or it reported an error of its own
PEER_REASONS = ("peer failed", "aborted by peer", "remote error")


def transfer_failure_status(reason: str | None) -> int:
    """The HTTP status of a request whose room failed: 504 when one of this node's deadlines ended it, 502 when the
    peer did (``PEER_REASONS``), 500 for a failure here. The answer's message carries the reason either way."""
    if ended_by_deadline(reason):
        return 504
    return PEER_FAILED_STATUS if reason is not None and reason.startswith(PEER_REASONS) else 500


def room_error_status(exc: Exception) -> int:
    """The HTTP status for the manager refusing a room: 409 for a reused room, 503 when its journal cannot be
    read (the node stops), 400 for anything else."""
    # a PD node's question, whose journal is loaded: a colocated node's start does without SQLAlchemy (0.3 s)
    from fsm_pd.control.core import RoomInUse
    from fsm_pd.store.journal import JournalError

    if isinstance(exc, JournalError):
        return UNAVAILABLE_STATUS
    return ROOM_IN_USE_STATUS if isinstance(exc, RoomInUse) else 400


def refuse_if_unhealthy(reason: str | None) -> None:
    """``EngineError(503)`` for a request that reaches a node that can no longer serve (``engine.health()``)."""
    if reason is not None:
        raise EngineError(f"this node cannot serve: {reason}", UNAVAILABLE_STATUS)


def max_context_for(model: LoadedModel, num_pages: int, page_size: int) -> int:
    """Prompt plus generated tokens: bounded by the model's positions and by what the pool can ever hold."""
    return min(model.config.max_position_embeddings, (num_pages - 1) * page_size)


def check_request(request: GenerateRequest, max_context: int, *, needs_bootstrap: bool,
                  pool_tokens: int | None = None) -> None:
    """Raise ``EngineError(400)`` for a request this engine can never serve. ``pool_tokens``: what the KV pool holds
    on a node that decodes; a request whose prompt plus ``max_new_tokens`` is more could never finish there, even
    alone, as retraction frees pages only for others."""
    if needs_bootstrap and request.bootstrap is None:
        raise EngineError(
            f"request {request.rid}: a PD node needs bootstrap_host, bootstrap_port and bootstrap_room", 400
        )
    if needs_bootstrap and not 0 <= request.bootstrap.room <= MAX_ROOM:
        raise EngineError(f"request {request.rid}: bootstrap_room must be in [0, {MAX_ROOM}], "
                          f"got {request.bootstrap.room}", 400)
    if not request.input_ids:
        raise EngineError(f"request {request.rid}: the prompt is empty", 400)
    k = request.top_logprobs_num if request.return_logprob else 0
    if needs_bootstrap and k and top_logprobs.wire_bytes(k, len(request.input_ids)) > top_logprobs.WIRE_BUDGET_BYTES:
        # the prompt's alternatives cross in one READY frame
        raise EngineError(f"request {request.rid}: top_logprobs_num={k} over a prompt of {len(request.input_ids)} "
                          f"tokens is too much to hand from prefill to decode; ask for fewer alternatives", 400)
    if len(request.input_ids) >= max_context:
        raise EngineError(
            f"request {request.rid}: the input ({len(request.input_ids)} tokens) is longer than the "
            f"model's context length ({max_context} tokens)",
            400,
        )
    wanted = len(request.input_ids) + request.sampling.max_new_tokens
    if pool_tokens is not None and wanted > pool_tokens:
        raise EngineError(
            f"request {request.rid}: {len(request.input_ids)} prompt tokens + max_new_tokens "
            f"{request.sampling.max_new_tokens} = {wanted} tokens can never fit this node's KV pool of "
            f"{pool_tokens} tokens; lower max_new_tokens",
            400,
        )


def pool_tokens_for(num_pages: int, page_size: int) -> int:
    """Tokens the whole KV pool holds (page 0 is padding)."""
    return (num_pages - 1) * page_size


def journal_path(journal: str | None, node_id: str) -> str:
    """The journal file; without one, a file in a fresh temporary directory (tests, throwaway nodes)."""
    if journal is not None:
        return journal
    return str(Path(tempfile.mkdtemp(prefix="fsm-pd-")) / f"{node_id}.db")
