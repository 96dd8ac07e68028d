"""The fixed-size header array that travels as buffer 0 of every jax-backend entry.

The transfer library checks only byte sizes, and its only failure signal is an error on a buffer. The manifest
gives D what the library does not: which uuid it got, the digest of the published layout (so a same-size spec
mismatch is caught), and, for a tombstone on jaxlibs without ``make_error_array``, why the entry ended. Its size
is fixed so that D can always ask for it, whatever P published.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MANIFEST_BYTES = 512
_MAGIC = b"FSMPD\x01\x00\x00"
_HEADER = struct.Struct("<8sQIIQ16s")  # magic, uuid, n_arrays, status, nbytes, layout digest
_TEXT_BYTES = MANIFEST_BYTES - _HEADER.size

STATUS_OK = 0
STATUS_ENDED = 1


class ManifestError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Manifest:
    uuid: int
    status: int
    n_arrays: int
    nbytes: int
    digest: bytes
    text: str  # summary of the published arrays, or the reason the entry ended

    def encode(self) -> np.ndarray:
        raw = _HEADER.pack(_MAGIC, self.uuid, self.n_arrays, self.status, self.nbytes, self.digest)
        text = self.text.encode("utf-8")[:_TEXT_BYTES]
        out = np.zeros(MANIFEST_BYTES, np.uint8)
        out[: len(raw)] = np.frombuffer(raw, np.uint8)
        out[len(raw) : len(raw) + len(text)] = np.frombuffer(text, np.uint8)
        return out

    @classmethod
    def decode(cls, data: np.ndarray) -> Manifest:
        raw = np.asarray(data, np.uint8).tobytes()
        if len(raw) != MANIFEST_BYTES:
            raise ManifestError(f"manifest has {len(raw)} bytes, expected {MANIFEST_BYTES}")
        magic, uuid, n_arrays, status, nbytes, digest = _HEADER.unpack_from(raw)
        if magic != _MAGIC:
            raise ManifestError("buffer 0 is not an fsm-pd manifest (uuid shared with a foreign entry?)")
        text = raw[_HEADER.size :].rstrip(b"\0").decode("utf-8", errors="replace")
        return cls(uuid, status, n_arrays, nbytes, digest, text)
