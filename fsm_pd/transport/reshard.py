"""The resharding plan: which KV slots of which prefill shard go to which decode shard, and as which bytes.

A pool split over ``tp`` devices holds ``slots`` KV slots per page and layer (``kernels.layout.kv_slot_heads``:
model heads, copies of them, padding); shard ``i`` holds slots ``[i * n, (i + 1) * n)``, and its part of a staging
array is ``[layers, rows, page_size, 2 * n, head_dim]`` (a slot is its head's K and V rows, side by side). When the
prefill node (P) and the decode node (D) split differently, every D slot that holds a model head must receive that
head's bytes from a P shard that holds it, and every padding slot gets zeros, which is what the model writes into a
padding slot: so D's pool ends up with exactly the bytes a handoff between equal splits would give it.

Both nodes compute the plan from the two layouts (P's comes in READY, D's in PREPARE): P to cut its staging into
*pieces*, D to know what to pull and where each piece lands. A piece is one run of slots, P shard ``src`` slots
``[src_slot, src_slot + count)`` to D shard ``dst`` slots ``[dst_slot, ...)``, published and pulled as an array of
its own under ``piece_uuid(uuid, index)``: D pulls, per D shard, from the P shards that hold its heads. A copied P
head is taken from the copy ``dst % copies``, so D shards spread their pulls over the copies. Equal splits give one
piece per shard (shard ``i`` to shard ``i``), and one device on both sides gives the single whole staging array of
a transfer without tensor parallelism.

Pure and jax-free: ints in, ints out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fsm_pd.kernels.layout import PAD_HEAD, kv_slot_heads

UUID_SPAN = (1 << 63) - 1  # transfer uuids live in [1, 2**63): backends.base.check_uuid


@dataclass(frozen=True, slots=True)
class Piece:
    """P shard ``src`` slots ``[src_slot, src_slot + count)`` -> D shard ``dst`` slots ``[dst_slot, ...)``."""

    index: int
    src: int
    src_slot: int
    dst: int
    dst_slot: int
    count: int

    def describe(self) -> str:
        return f"piece {self.index} (prefill shard {self.src} -> decode shard {self.dst})"


@dataclass(frozen=True, slots=True)
class Fill:
    """D shard ``dst`` slots ``[dst_slot, dst_slot + count)`` are padding: zeros, nothing is pulled for them."""

    dst: int
    dst_slot: int
    count: int


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    src_tp: int
    dst_tp: int
    src_shard_slots: int  # slots per P shard
    dst_shard_slots: int  # slots per D shard
    pieces: tuple[Piece, ...]
    fills: tuple[Fill, ...]

    @property
    def unsharded(self) -> bool:
        """One device on both sides (no tensor parallelism): the whole staging array is the one piece."""
        return self.src_tp == 1 and self.dst_tp == 1

    def whole(self, piece: Piece) -> bool:
        """The piece is all of its P shard's slots (P sends its shard's staging as it is, no cut)."""
        return piece.src_slot == 0 and piece.count == self.src_shard_slots

    def into(self, dst: int) -> list[Piece | Fill]:
        """What lands in D shard ``dst``, in slot order."""
        parts = [p for p in (*self.pieces, *self.fills) if p.dst == dst]
        return sorted(parts, key=lambda part: part.dst_slot)


@lru_cache(maxsize=256)
def plan_reshard(kv_heads: int, src_tp: int, dst_tp: int) -> ReshardPlan:
    """The plan between a pool of ``kv_heads`` model KV heads split ``src_tp`` ways and one split ``dst_tp`` ways."""
    src, dst = kv_slot_heads(kv_heads, src_tp), kv_slot_heads(kv_heads, dst_tp)
    src_n, dst_n = len(src) // src_tp, len(dst) // dst_tp
    holders: dict[int, list[int]] = {}  # model head -> the P slots (global) holding it
    for slot, head in enumerate(src):
        if head != PAD_HEAD:
            holders.setdefault(head, []).append(slot)
    runs: list[list[int]] = []  # [src, src_slot, dst, dst_slot, count]
    fills: list[list[int]] = []  # [dst, dst_slot, count]
    for slot, head in enumerate(dst):
        shard, local = divmod(slot, dst_n)
        if head == PAD_HEAD:
            if fills and fills[-1][0] == shard and fills[-1][1] + fills[-1][2] == local:
                fills[-1][2] += 1
            else:
                fills.append([shard, local, 1])
            continue
        copies = holders[head]
        src_shard, src_local = divmod(copies[shard % len(copies)], src_n)
        last = runs[-1] if runs else None
        if (last is not None and last[0] == src_shard and last[2] == shard and last[1] + last[4] == src_local
                and last[3] + last[4] == local):
            last[4] += 1
        else:
            runs.append([src_shard, src_local, shard, local, 1])
    pieces = tuple(Piece(i, *run) for i, run in enumerate(runs))
    return ReshardPlan(src_tp, dst_tp, src_n, dst_n, pieces, tuple(Fill(*fill) for fill in fills))


def plan_between(src_layout: Mapping[str, Any], dst_layout: Mapping[str, Any]) -> ReshardPlan:
    """``plan_reshard`` for two ``KVLayout.to_dict()`` records (a record without ``tp`` is one device's)."""
    if src_layout["kv_heads"] != dst_layout["kv_heads"]:
        raise ValueError(f"the layouts hold {src_layout['kv_heads']} and {dst_layout['kv_heads']} KV heads")
    return plan_reshard(int(src_layout["kv_heads"]), int(src_layout.get("tp", 1)), int(dst_layout.get("tp", 1)))


def piece_uuid(uuid: int, index: int) -> int:
    """The transfer uuid of piece ``index`` of the transfer published as ``uuid``: ``uuid`` itself for piece 0, so
    a transfer of one piece keeps its uuid; still in ``[1, 2**63)``."""
    return (uuid - 1 + index) % UUID_SPAN + 1


@dataclass(frozen=True, slots=True)
class ByteRun:
    """``repeat`` blocks of ``length`` bytes: block ``k`` is at ``offset + k * stride`` (``stride`` = ``length``
    for a contiguous piece)."""

    offset: int
    stride: int
    length: int
    repeat: int


def byte_runs(plan: ReshardPlan, part: Piece | Fill, *, num_layers: int, rows: int, page_size: int,
              head_dim: int, itemsize: int) -> dict[str, ByteRun]:
    """Where ``part`` reads and writes, in bytes of C-contiguous staging arrays of ``rows`` pages.

    A slot's K and V for one (layer, page row, token) are ``2 * head_dim`` contiguous values, and a shard's slots sit
    side by side, so a run of slots is one block per (layer, row, token). A piece gives ``src`` (in P shard
    ``part.src``'s staging), ``wire`` (the piece's own array) and ``dst`` (in D shard ``part.dst``'s staging); a fill
    gives ``dst`` only.
    """
    slot_bytes = 2 * head_dim * itemsize
    repeat = num_layers * rows * page_size
    length = part.count * slot_bytes
    runs = {"dst": ByteRun(part.dst_slot * slot_bytes, plan.dst_shard_slots * slot_bytes, length, repeat)}
    if isinstance(part, Piece):
        runs["src"] = ByteRun(part.src_slot * slot_bytes, plan.src_shard_slots * slot_bytes, length, repeat)
        runs["wire"] = ByteRun(0, length, length, repeat)
    return runs
