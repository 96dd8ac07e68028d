"""A chunked handoff: a prefill node streams a long prompt's KV piece by piece while its later chunks still compute.

Chunked prefill computes a long prompt over several steps. Rather than gather and publish everything after the last
step, the prefill node announces the transfer after the first chunk (``kv_ready`` with ``piece_pages``: READY goes
out at once) and publishes the prompt's pages in fixed *pieces* of ``piece_pages`` pages, each as soon as every page
in it holds final KV (``kv_chunk`` events, one per computed chunk); the decode node pulls the pieces in order, each
parked on the prefill node until it is published. Pieces are fixed by page count, not by the scheduler's chunks
(whose sizes depend on what else shares the step), so both ends know them from READY alone.

What READY cannot carry yet, the first sampled token, rides the data: a last, tiny piece (the *trailer*) published
after the last chunk. The decode node's pull ends, and its ``pulled`` event carries the token, only once the trailer
has landed, so the receiver's Transferring ends exactly when every byte including the trailer is final, and no new
state or message is needed. (A side-channel follow-up message would need a new trigger on the receiver and an
ordering rule against the pull's end; the trailer gets both from the byte stream.)

Every piece, the trailer included, is an ordinary entry under ``piece_uuid(uuid, i)``: the hold table's rules (one
delivery, release on PULLED, ``fail`` on the room's failure, expiry) apply to each, and ``fail`` of a piece not yet
published makes its parked pull fail at once. This module is the plan both sides share; no jax here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# int32 words of the trailer: the first sampled token (then, with the KV checksum, a flag and one per piece and layer)
TRAILER_WORDS = 1


@dataclass(frozen=True, slots=True)
class Trailer:
    """The trailer piece's place in a pull (``PullPort.pull(piece=...)``): its spec is ``int32[words]``."""

    index: int
    words: int = TRAILER_WORDS

    def describe(self) -> str:
        return f"trailer (piece {self.index})"


@dataclass(frozen=True, slots=True)
class ChunkPiece:
    index: int
    pages: tuple[int, ...]

    def describe(self) -> str:
        return f"chunk piece {self.index} ({len(self.pages)} pages)"


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """The pieces of ``pages`` (the pages a transfer moves), ``piece_pages`` each; the trailer is piece ``len``."""

    pieces: tuple[ChunkPiece, ...]
    skipped: int  # leading pages of the room the transfer does not move (the decode node's prefix cache holds them)
    checksum_layers: int = 0  # the trailer carries a checksum per piece and layer (0: none)

    @classmethod
    def of(cls, pages: list[int], piece_pages: int, skipped: int = 0, checksum_layers: int = 0) -> ChunkPlan:
        if piece_pages < 1:
            raise ValueError(f"piece_pages must be at least 1, got {piece_pages}")
        count = math.ceil(len(pages) / piece_pages)
        return cls(tuple(ChunkPiece(i, tuple(pages[i * piece_pages:(i + 1) * piece_pages])) for i in range(count)),
                   skipped, checksum_layers)

    @property
    def trailer(self) -> Trailer:
        checksums = 1 + len(self.pieces) * self.checksum_layers if self.checksum_layers else 0  # a flag, the values
        return Trailer(len(self.pieces), TRAILER_WORDS + checksums)

    @property
    def entries(self) -> int:
        """Entries published under ``piece_uuid(uuid, 0 ..)``: every piece and the trailer."""
        return len(self.pieces) + 1

    def final(self, final_pages: int) -> int:
        """How many leading pieces hold only final KV once the room's first ``final_pages`` pages do."""
        done = 0
        end = self.skipped
        for piece in self.pieces:
            end += len(piece.pages)
            if end > final_pages:
                break
            done += 1
        return done


def streams(ctx: dict, pages: list[int], unsharded: bool) -> bool:
    """Whether a room's handoff goes piece by piece: the prefill node announced it early (``piece_pages``), neither
    node splits its pool (``unsharded``: no tensor parallelism on either side), and there is more than one piece to
    move. Otherwise the last chunk's ``kv_chunk`` runs the whole-prompt handoff."""
    piece_pages = int(ctx.get("piece_pages") or 0)
    return piece_pages > 0 and unsharded and len(pages) > piece_pages

