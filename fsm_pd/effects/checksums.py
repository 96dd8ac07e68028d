"""The handlers' side of the KV checksum: what P announces, what D compares, and the words of a mismatch.

The values themselves come from the pool-operations ports (``PrefillKV.sent_checksum``,
``DecodeKV.received_checksum``: crc32c of the pages in ``kernels/kv_checksum.py``, a token in the simulation), one
per piece of the handoff and layer. P computes them over the KV as its publishing job left it final (summed by the
send itself on the default path); D's are the sums of the bytes as they land in its pages (a streamed write sums
each piece while it is in cache), taken in the job of the handoff's last write if no other job ran on the model
thread since the first write, else read again from its pages there; it compares them here, before the request's
first decode step (``docs/data-plane.md``, "The KV checksum"). No jax here, so the simulation runs this code.

How they travel: a whole handoff's in READY (``kv_checksum``); a chunked handoff's pieces are not final when READY
goes, so READY says ``chunk_checksums`` and the trailer carries them after the first token (``trailer_words``).

Mixed settings: D with the check off ignores what P sent; P with it off sends none, and D with it on then lets the
handoff through and records ``missing`` (a log line and a counter), never a failure. The values name their algorithm
(READY's ``kv_checksum_algorithm``: crc32c for a pool on CPU devices, the device hash ``kvmix32`` on an accelerator);
D compares them only with values of the same algorithm, and records ``other_algorithm`` (a log line and a counter,
never a failure) when P's are of another (a CPU prefill node beside an accelerator decode node).
"""

from __future__ import annotations

from collections.abc import Sequence

from fsm_pd.machines.receiver import KV_CHECKSUM_MISMATCH

# What D recorded about a room's checksum (the ``scattered`` event's ``kv_checksum_check``; counted in /metrics)
VERIFIED = "verified"
MISSING = "missing"  # the prefill node sent none (its --kv-checksum off, or its pool is not checksummed)
OTHER_ALGORITHM = "other_algorithm"  # the prefill node's values are of another algorithm than ours
UNCHECKED = "unchecked"  # our port gave no values (no real pool does now: kept for the metric and old journals)
OFF = "off"  # this node's --kv-checksum off
OUTCOMES = (VERIFIED, MISSING, OTHER_ALGORITHM, UNCHECKED, OFF)
# what READY's ``kv_checksum_algorithm`` means when a prefill node does not name one (before it was named)
DEFAULT_ALGORITHM = "crc32c"


class ChecksumMismatch(Exception):
    """The KV in D's pages is not what P sent; the message is the failure's reason detail."""


def mismatch(expected: Sequence[Sequence[int]], got: Sequence[Sequence[int]], name: str = "piece") -> str | None:
    """Where two ``[piece][layer]`` checksums first differ, as a failure reason; None when they are equal."""
    if len(expected) != len(got):
        return f"{KV_CHECKSUM_MISMATCH}: {len(expected)} {name}s announced, {len(got)} received"
    for index, (want, have) in enumerate(zip(expected, got, strict=True)):
        if len(want) != len(have):
            return f"{KV_CHECKSUM_MISMATCH}: {name} {index}: {len(want)} layers announced, {len(have)} received"
        bad = [layer for layer, (a, b) in enumerate(zip(want, have, strict=True)) if int(a) != int(b)]
        if bad:
            layer = bad[0]
            more = f" (and {len(bad) - 1} more layers)" if len(bad) > 1 else ""
            return (f"{KV_CHECKSUM_MISMATCH}: {name} {index} layer {layer}: {int(have[layer]):#010x} in our pages, "
                    f"{int(want[layer]):#010x} from the prefill node{more}")
    return None


def trailer_words(first_token: int, sums: Sequence[Sequence[int] | None] | None, layers: int) -> list[int]:
    """A chunked handoff's trailer: the first token; with checksums announced (``sums`` not None: one entry per
    piece), a flag (1: valid; 0: P's pool is not checksummed, the values are zeros) and every piece's ``layers``
    values as int32 words (``ChunkPlan.trailer`` has the length)."""
    if sums is None:
        return [first_token]
    if any(part is None for part in sums):
        return [first_token, 0, *([0] * (len(sums) * layers))]
    words = [int(v) - (1 << 32) if int(v) >= 1 << 31 else int(v) for part in sums for v in part]
    return [first_token, 1, *words]


def read_trailer(words: Sequence[int], layers: int) -> tuple[int, list[list[int]] | None]:
    """The first token and the pieces' checksums (None if the trailer holds none) of ``trailer_words``' output."""
    if len(words) < 2 or int(words[1]) != 1:
        return int(words[0]), None
    flat = [int(w) & 0xFFFFFFFF for w in words[2:]]
    return int(words[0]), [flat[i : i + layers] for i in range(0, len(flat), layers)]
