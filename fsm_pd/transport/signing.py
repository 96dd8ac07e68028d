"""Side-channel frames: the shared secret, HMAC-SHA256 signing, and the size-bounded frame format.

A frame is one ZMQ message part::

    [version: 1 byte][type: 1 byte][body: msgpack][mac: 32 bytes]

``mac = HMAC-SHA256(secret, version || type || body)``. The header is covered too, so a valid body cannot be replayed
under another type. ``open_frame`` checks in order of cost and trust: size first (nothing larger than the limit is
even looked at), then version, then the MAC (in constant time), and only then decodes the body. Every rejection is a
``RejectedFrame`` with a short ``reason`` the side channel counts, or a ``MalformedMessage`` from the body decoder.

The secret is required: there is no built-in default, because a default shared by every install is no secret. Local
clusters make one with ``generate_secret()`` and hand it to their children with ``secret_env()``; servers read it
with ``secret_from_env()`` or parse the ``--side-channel-secret`` flag with ``parse_secret()``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from typing import Final

import msgpack

from fsm_pd.transport.messages import Message, decode_body, encode_body

# 2: every message carries the sender's ``instance`` and ``origin``; HEARTBEAT is a ping/pong; ABORT_ACK is gone.
# A version-1 peer's frames are dropped as ``bad_version``: all nodes of a cluster run one version.
WIRE_VERSION: Final = 2
HEADER_BYTES: Final = 2
MAC_BYTES: Final = hashlib.sha256().digest_size  # 32
DEFAULT_MAX_FRAME_BYTES: Final = 1 << 20  # 1 MiB: a READY with full input logprobs for a long prompt fits easily

SECRET_ENV: Final = "FSM_PD_SIDE_CHANNEL_SECRET"
MIN_SECRET_BYTES: Final = 16


class RejectedFrame(ValueError):
    """A frame refused before its body was trusted. ``reason`` is one of the ``REJECT_REASONS``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


REJECT_REASONS: Final = ("oversized", "bad_version", "unsigned", "bad_mac")


class SecretError(ValueError):
    """No usable side-channel secret was configured."""


# -- the secret -----------------------------------------------------------------------------------------------------


def generate_secret() -> bytes:
    """32 fresh random bytes, for a local cluster that starts its own nodes."""
    return secrets.token_bytes(32)


# how to make a secret, for every message that asks for one
MAKE_SECRET = "make one with `python -c 'import secrets; print(secrets.token_hex(32))'`"


def parse_secret(text: str) -> bytes:
    """Parse a secret written as hex (the env var and the CLI flag); raise ``SecretError`` if it is unusable."""
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise SecretError(f"the side-channel secret must be hex; {MAKE_SECRET}") from None
    return check_secret(secret)


def check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"the side-channel secret must be at least {MIN_SECRET_BYTES} bytes; {MAKE_SECRET}")
    return secret


def secret_from_env(environ: Mapping[str, str] | None = None) -> bytes:
    """The secret from ``FSM_PD_SIDE_CHANNEL_SECRET`` (hex); raises ``SecretError`` if it is unset or unusable."""
    env = os.environ if environ is None else environ
    text = env.get(SECRET_ENV)
    if not text:
        raise SecretError(
            f"{SECRET_ENV} is not set: every node of a cluster needs the same side-channel secret "
            f"(hex, at least {MIN_SECRET_BYTES} bytes), from --side-channel-secret or the variable; {MAKE_SECRET} "
            f"and give it to every node"
        )
    return parse_secret(text)


def secret_env(secret: bytes) -> dict[str, str]:
    """The environment entries that make a child process's ``secret_from_env()`` return ``secret``."""
    return {SECRET_ENV: check_secret(secret).hex()}


# -- frames ---------------------------------------------------------------------------------------------------------


def _mac(secret: bytes, signed_part: bytes) -> bytes:
    return hmac.new(secret, signed_part, hashlib.sha256).digest()


def seal(msg: Message, secret: bytes) -> bytes:
    """Encode and sign ``msg`` into one frame."""
    signed_part = bytes((WIRE_VERSION, msg.TYPE)) + encode_body(msg)
    return signed_part + _mac(secret, signed_part)


def open_frame(frame: bytes, secret: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """Verify and decode one frame. Raises ``RejectedFrame`` or ``MalformedMessage``, never anything else."""
    if len(frame) > max_frame_bytes:
        raise RejectedFrame("oversized", f"{len(frame)} bytes > limit {max_frame_bytes}")
    if len(frame) < HEADER_BYTES + MAC_BYTES:
        raise RejectedFrame("unsigned", f"{len(frame)} bytes is too short to carry a MAC")
    if frame[0] != WIRE_VERSION:
        raise RejectedFrame("bad_version", f"wire version {frame[0]}, expected {WIRE_VERSION}")
    signed_part, mac = frame[:-MAC_BYTES], frame[-MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(secret, signed_part)):
        if _is_bare_body(frame[HEADER_BYTES:]):
            raise RejectedFrame("unsigned", "a complete body with no MAC after it")
        raise RejectedFrame("bad_mac", "MAC does not match (wrong secret or altered frame)")
    return decode_body(frame[1], frame[HEADER_BYTES:-MAC_BYTES])


def _is_bare_body(data: bytes) -> bool:
    """Whether ``data`` is exactly one msgpack object: a frame sent without a MAC, as opposed to a wrong one.

    Only used to name the reason for a frame that already failed verification; a signed frame never qualifies,
    because its 32 MAC bytes follow the body.
    """
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1))
    try:
        unpacker.feed(data)
        unpacker.unpack()
    except Exception:  # any parse failure just means "not a bare body"
        return False
    return unpacker.tell() == len(data)
