"""Wire format of the zmq backend: a pull is one request, a header, credit-paced data chunks and an end marker.

D (DEALER, one fresh socket per pull) -> P (ROUTER)::

    [b"PULL",   msgpack {v, uuid, digest, window, timeout_s}]
    [b"CREDIT", u32 chunks consumed]              # keeps at most `window` chunks in flight

P -> D::

    [b"HEAD",   msgpack {arrays: [[shape, dtype], ...], chunk_bytes}]
    [b"D",      raw bytes]                        # chunks in plan order, never a copy of the staging on P
    [b"DONE"]
    [b"FAIL",   msgpack {reason, blame, published}]

Chunks carry no index: both sides derive the same plan from the header (array by array, ``chunk_bytes`` at a
time), and TCP plus a single socket per pull keep them in order. D checks every chunk's length against the plan.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import msgpack

PROTOCOL_VERSION = 1
PULL, CREDIT = b"PULL", b"CREDIT"
HEAD, DATA, DONE, FAIL = b"HEAD", b"D", b"DONE", b"FAIL"
_U32 = struct.Struct("<I")


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> dict:
    obj = msgpack.unpackb(data, raw=False)
    if not isinstance(obj, dict):
        raise ValueError("message body is not a map")
    return obj


def pack_u32(n: int) -> bytes:
    return _U32.pack(n)


def unpack_u32(data: bytes) -> int:
    return _U32.unpack(data)[0]


def chunk_plan(sizes: Sequence[int], chunk_bytes: int) -> list[tuple[int, int, int]]:
    """``(array index, byte offset, length)`` of every chunk, in sending order; empty arrays have no chunk."""
    plan = []
    for index, size in enumerate(sizes):
        for offset in range(0, size, chunk_bytes):
            plan.append((index, offset, min(chunk_bytes, size - offset)))
    return plan

