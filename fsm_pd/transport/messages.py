"""The side channel's closed set of messages and their msgpack body codec.

Every message is a frozen, slotted, keyword-only dataclass. The wire body is a msgpack array of the field values in
declaration order (common fields first), so a message costs no key names on the wire. The type travels outside the
body, in the frame header (see ``signing.py``), and ``CODEC`` maps it to the class: there is no lookup by class name
and no pickle, so a peer can only ever make us build one of the five classes below.

Every message names its sender three ways (``_Message``): ``sender`` (the node id, for people and journals),
``origin`` (the sender's own side-channel address, so any message can be answered and tied to the peer at that
address) and ``instance`` (a random id the sender's process drew at start, so a process restarted at the same
address and node id is told apart from the one it replaced).

Field types are checked once, in ``__post_init__``, so a message built locally and a message decoded from the wire pass
the same checks, and anything wrong raises ``MalformedMessage`` and nothing else. The checks are derived from the
annotations through a small closed table (``_CHECKS``); a class whose annotation has no entry fails at import.
"""

from __future__ import annotations

import math
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, ClassVar, Final

import msgpack

from fsm_pd.runtime.random_bits import random_bits

_U64_LIMIT: Final = 1 << 64
MAX_INSTANCE_CHARS: Final = 64


class MalformedMessage(ValueError):
    """A body that is not a well-formed message of its declared type."""


class MessageType(IntEnum):
    """The one-byte type tag in the frame header. Values are wire format: never renumber."""

    PREPARE = 1
    READY = 2
    PULLED = 3
    ABORT = 4
    # 5 was ABORT_ACK (wire version 1). It was never sent: no state waits for it, since each side releases a room on
    # its own and every state has a deadline. Retired; do not reuse the number.
    HEARTBEAT = 6


# -- field checks: annotation text -> function that returns the normalised value or raises MalformedMessage ---------


def _check_uint(value: Any) -> int:
    # bool is an int subclass; a True where a room id belongs is a bug, not a 1.
    if type(value) is not int or not 0 <= value < _U64_LIMIT:
        raise MalformedMessage(f"expected an int in [0, 2**64), got {value!r:.80}")
    return value


def _check_str(value: Any) -> str:
    if type(value) is not str:
        raise MalformedMessage(f"expected a str, got {type(value).__name__}")
    return value


def _check_float(value: Any) -> float:
    # An int is accepted and widened, so that a logprob of 0 written as ``0`` is not an error.
    if type(value) not in (float, int):
        raise MalformedMessage(f"expected a float, got {type(value).__name__}")
    return float(value)


def _check_optional_float(value: Any) -> float | None:
    return None if value is None else _check_float(value)


def _check_optional_str(value: Any) -> str | None:
    return None if value is None else _check_str(value)


def _check_optional_float_list(value: Any) -> list[float] | None:
    if value is None:
        return None
    if type(value) is not list:
        raise MalformedMessage(f"expected a list of floats or None, got {type(value).__name__}")
    return [_check_float(item) for item in value]


_LAYOUT_VALUE_TYPES: Final = (type(None), bool, int, float, str)


def _check_layout(value: Any) -> dict:
    # A layout is a flat record (KVLayout.to_dict()); whether it is a *valid* layout is the handshake's business.
    if type(value) is not dict:
        raise MalformedMessage(f"expected a dict, got {type(value).__name__}")
    for key, item in value.items():
        if type(key) is not str or type(item) not in _LAYOUT_VALUE_TYPES:
            raise MalformedMessage(f"layout entries must be str -> scalar, got {key!r:.40}: {type(item).__name__}")
    return dict(value)


def _check_optional_checksums(value: Any) -> list[list[int]] | None:
    """A KV checksum: one list per piece of uint32 values, one per layer (``kernels/kv_checksum.py``)."""
    if value is None:
        return None
    if type(value) is not list or any(type(part) is not list for part in value):
        raise MalformedMessage("expected a list of lists of uint32 or None")
    for part in value:
        if any(type(v) is not int or not 0 <= v < 1 << 32 for v in part):
            raise MalformedMessage("checksum values must be uint32")
    return [list(part) for part in value]


def _check_bool(value: Any) -> bool:
    if type(value) is not bool:
        raise MalformedMessage(f"expected a bool, got {type(value).__name__}")
    return value


_CHECKS: Final[dict[str, Callable[[Any], Any]]] = {
    "int": _check_uint,
    "str": _check_str,
    "bool": _check_bool,
    "float": _check_float,
    "float | None": _check_optional_float,
    "list[float] | None": _check_optional_float_list,
    "list[list[int]] | None": _check_optional_checksums,
    "str | None": _check_optional_str,
    "dict": _check_layout,
}


# What a value of a common annotation must be to pass its check unchanged, as an expression over ``v``: a class's
# checks are compiled once into one function (``_checker``) that tests these inline and calls the check only for a
# value that fails them (to normalise it or raise) or for an annotation without one. Building a message called
# ``fields()`` and one function per field, and a READY has 24: it took 32 us to build, 18 with the calls kept and 10
# with this, and under --role pd each handoff builds two on the model thread, its caches cold from the forward pass.
_PASSES: Final[dict[str, str]] = {
    "int": "type(v) is int and 0 <= v < _U64_LIMIT",
    "str": "type(v) is str",
    "bool": "type(v) is bool",
    "float": "type(v) is float",
    "float | None": "v is None or type(v) is float",
    "str | None": "v is None or type(v) is str",
    "list[float] | None": "v is None",
    "list[list[int]] | None": "v is None",
}
_CHECKERS: dict[type, Callable[[Any], None]] = {}


def _checker(cls: type) -> Callable[[Any], None]:
    lines = ["def check(self):"]
    for f in fields(cls):
        lines.append(f"    v = self.{f.name}")
        call = f"_normalise(self, {f.name!r}, _CHECKS[{f.type!r}], v)"
        passes = _PASSES.get(f.type)
        lines.append(f"    if not ({passes}): {call}" if passes else f"    {call}")
    scope = {"_U64_LIMIT": _U64_LIMIT, "_CHECKS": _CHECKS, "_normalise": _normalise}
    exec("\n".join(lines), scope)  # noqa: S102 - our own text, from the class's annotations and _PASSES
    check = _CHECKERS[cls] = scope["check"]
    return check


def _normalise(msg: Any, name: str, check: Callable[[Any], Any], value: Any) -> None:
    try:
        normalised = check(value)
    except MalformedMessage as exc:
        raise MalformedMessage(f"{type(msg).__name__}.{name}: {exc}") from None
    if normalised is not value:
        object.__setattr__(msg, name, normalised)


# -- the messages ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _Message:
    """Fields every message carries. ``nonce`` and ``sent_at`` feed the receiver's replay and staleness checks."""

    TYPE: ClassVar[MessageType]

    room: int  # SGLang's bootstrap_room; 0 for HEARTBEAT
    sender: str  # node id of the sender (self-declared: see docs/side-channel.md on what the MAC does not prove)
    instance: str  # the sender process's instance id (new_instance_id), new at every start
    origin: str  # the sender's own side-channel address: where answers and heartbeats go
    nonce: int  # random 63-bit, fresh per message
    sent_at: float  # sender's wall clock, seconds since the epoch

    def __post_init__(self) -> None:
        (_CHECKERS.get(type(self)) or _checker(type(self)))(self)
        if not math.isfinite(self.sent_at):
            raise MalformedMessage(f"{type(self).__name__}.sent_at must be finite")
        if not 0 < len(self.instance) <= MAX_INSTANCE_CHARS:
            raise MalformedMessage(f"{type(self).__name__}.instance must have 1 to {MAX_INSTANCE_CHARS} characters")
        if not self.origin:
            raise MalformedMessage(f"{type(self).__name__}.origin must not be empty")


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepare(_Message):
    """D -> P: pages are reserved; here is where to answer and what my pool looks like."""

    TYPE: ClassVar[MessageType] = MessageType.PREPARE

    transfer_id: int
    reply_to: str  # D's side-channel address, e.g. "tcp://127.0.0.1:5555"
    layout: dict  # KVLayout.to_dict()
    page_count: int
    prompt_len: int
    # D's own prefix cache already holds the first ``cached_pages`` of the prompt's pages: send the rest
    cached_pages: int = 0
    # D verifies the KV checksum (its --kv-checksum): when False, P computes none
    kv_checksum: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready(_Message):
    """P -> D: the KV is published under ``uuid`` at ``transfer_addr``; pull it, and here is the first token."""

    TYPE: ClassVar[MessageType] = MessageType.READY

    transfer_id: int
    uuid: int
    transfer_addr: str
    backend: str
    layout: dict
    page_count: int
    first_token: int
    first_logprob: float | None
    input_logprobs: list[float] | None
    # With top_logprobs_num: the first token's and the prompt's alternatives, packed (serving.top_logprobs.to_wire)
    top_logprobs: str | None = None
    # prompt tokens P took from its own prefix cache instead of computing them (the answer's cached_tokens)
    cached_tokens: int = 0
    # A chunked handoff (effects/chunked.py): the pages come in ``chunks`` pieces of ``chunk_pages`` pages, then a
    # trailer with the first token (``first_token`` above is then 0 and means nothing). 0: one whole staging array.
    chunks: int = 0
    chunk_pages: int = 0
    # The KV checksum (kernels/kv_checksum.py) P computed when the KV was final: one list per piece of the resharding
    # plan, one crc32c per layer. None: P computed none (--kv-checksum off, or a pool on an accelerator). A chunked
    # handoff's pieces are not final yet when READY goes: ``chunk_checksums`` then says that the trailer carries them.
    kv_checksum: list[list[int]] | None = None
    chunk_checksums: bool = False
    # A whole handoff sent while it is checksummed (a progressive backend, one piece): the checksum follows the data
    # as one more entry of the transfer (``piece_uuid(uuid, 1)``, a trailer's words), instead of ``kv_checksum``.
    checksum_entry: bool = False
    # What the values (wherever they travel) are: "crc32c" (a pool on CPU devices) or "kvmix32" (the device hash,
    # kernels/kv_hash.py). D compares them only with its own values of the same algorithm.
    kv_checksum_algorithm: str = "crc32c"


@dataclass(frozen=True, slots=True, kw_only=True)
class Pulled(_Message):
    """D -> P: the pull finished and was verified; release the staging buffer."""

    TYPE: ClassVar[MessageType] = MessageType.PULLED

    transfer_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort(_Message):
    """Either side -> the other: I gave up on this room."""

    TYPE: ClassVar[MessageType] = MessageType.ABORT

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(_Message):
    """A liveness probe of the peer node itself, not tied to a room. A ping (``pong=False``) is answered by a pong
    to its ``origin``; both show the sender's ``instance``, so a restart is seen at the next probe."""

    TYPE: ClassVar[MessageType] = MessageType.HEARTBEAT

    pong: bool

    def __post_init__(self) -> None:
        super(Heartbeat, self).__post_init__()  # explicit form: slots=True replaces the class, breaking bare super()
        if self.room != 0:
            raise MalformedMessage("Heartbeat.room must be 0")


Message = Prepare | Ready | Pulled | Abort | Heartbeat

# The one table from wire type to class. Decoding goes through here and nowhere else.
CODEC: Final[dict[MessageType, type[_Message]]] = {cls.TYPE: cls for cls in (Prepare, Ready, Pulled, Abort, Heartbeat)}
assert set(CODEC) == set(MessageType), "every MessageType needs exactly one class"

# Field names per class, in wire order; computed once, and every annotation checked against _CHECKS at import.
_FIELD_NAMES: Final[dict[MessageType, tuple[str, ...]]] = {}
for _type, _cls in CODEC.items():
    for _f in fields(_cls):
        if _f.type not in _CHECKS:
            raise TypeError(f"{_cls.__name__}.{_f.name}: no wire check for annotation {_f.type!r}")
    _FIELD_NAMES[_type] = tuple(_f.name for _f in fields(_cls))


def encode_body(msg: Message) -> bytes:
    """The msgpack body of ``msg`` (the type is not included: it goes in the frame header)."""
    values = [getattr(msg, name) for name in _FIELD_NAMES[msg.TYPE]]
    return msgpack.packb(values, use_bin_type=True)


def decode_body(type_byte: int, body: bytes) -> Message:
    """Build a message of wire type ``type_byte`` from ``body``. Raises ``MalformedMessage`` on any defect."""
    try:
        msg_type = MessageType(type_byte)
    except ValueError:
        raise MalformedMessage(f"unknown message type {type_byte}") from None
    names = _FIELD_NAMES[msg_type]
    try:
        # Containers are capped by the frame size already; strict_map_key keeps map keys to str/bytes.
        values = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types (ValueError, ExtraData, FormatError, ...)
        raise MalformedMessage(f"body is not msgpack: {type(exc).__name__}") from None
    if type(values) is not list or len(values) != len(names):
        raise MalformedMessage(f"{msg_type.name} body must be an array of {len(names)} fields")
    return CODEC[msg_type](**dict(zip(names, values, strict=True)))


def new_nonce() -> int:
    return random_bits(63)  # the OS's randomness in batches: no system call on the node loop (runtime/random_bits)


def new_instance_id(rng: random.Random | None = None) -> str:
    """16 random hex characters naming one run of one node process. A simulation passes its seeded ``rng`` so that
    the same seed gives the same ids; everything else uses the OS's randomness."""
    return f"{(rng.getrandbits(64) if rng is not None else secrets.randbits(64)):016x}"


def stamped(cls: type[_Message], *, sender: str, instance: str, origin: str, **fields_: Any) -> Message:
    """Build ``cls`` with a fresh nonce and the current wall-clock time; the caller gives the rest."""
    return cls(sender=sender, instance=instance, origin=origin, nonce=new_nonce(), sent_at=time.time(), **fields_)
