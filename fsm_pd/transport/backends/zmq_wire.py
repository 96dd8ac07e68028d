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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class PullRequest:
    """A PULL's body, checked whole on arrival: a pull parked until its entry is published must not fail later, on
    the server's thread, for a field it lacked from the start."""

    v: object
    uuid: int
    digest: bytes
    window: int
    timeout_s: float

    @classmethod
    def parse(cls, body: bytes) -> PullRequest:
        """Raises ``ValueError`` naming what is missing or wrong."""
        fields = unpack(body)
        try:
            uuid, digest = fields["uuid"], fields["digest"]
            window, timeout_s = fields["window"], fields.get("timeout_s", 60.0)
        except KeyError as missing:
            raise ValueError(f"PULL without {missing}") from None
        if not isinstance(uuid, int) or isinstance(uuid, bool):
            raise ValueError(f"PULL uuid is not an integer: {uuid!r}")
        if not isinstance(digest, bytes):
            raise ValueError("PULL digest is not bytes")
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"PULL window is not a positive integer: {window!r}")
        if not isinstance(timeout_s, int | float) or not 0 < timeout_s < float("inf"):
            raise ValueError(f"PULL timeout_s is not a positive number of seconds: {timeout_s!r}")
        return cls(fields.get("v"), uuid, digest, window, float(timeout_s))


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

