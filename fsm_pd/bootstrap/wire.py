"""The bootstrap server's JSON shapes and their validation: SGLang's, plus the fields fsm-pd adds.

SGLang's server takes what a prefill rank sends on faith (``int(data[...])``), so a typo in a field is a 500 there and
a wrong rank index silently corrupts its table. Here every request is checked first and refused with a 400 and a
message that names the field; nothing a client sends reaches the registry unchecked.

Compatibility rules that shape this module (see ``docs/bootstrap.md``):

* A registration carries SGLang's fields, required as SGLang's server requires them; ``load_balance_method``,
  ``enable_dsa_cache_layer_split`` and ``prefill_http_port`` may be absent. Unknown keys are ignored (newer SGLang
  versions send more), so an SGLang prefill can register here unchanged.
* fsm-pd's extra fields (``EXTRA_FIELDS``) travel in the same registration and come back only in the per-rank
  ``GET /route`` answer, which SGLang's decode reads as a plain dict. They never appear in the layout answer
  (``SERVER_INFO_KEYS``), because SGLang's decode builds ``PrefillServerInfo(**json)`` and fails on unknown keys.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

MAX_TEXT_CHARS = 1024  # addresses and names; far above any real one, small enough to keep the table cheap
MAX_PARALLEL_SIZE = 1 << 16  # a TP/CP/DP/PP size past this is a bug, and would make "ready" unreachable
ROOM_LIMIT = 1 << 64  # rooms are random 63-bit ints (SGLang's router); 0 is the health-check room
_INT_TEXT = re.compile(r"-?\d{1,20}")

# The layout answer of ``GET /route`` with all four parameters -1, key for key (SGLang ``PrefillServerInfo`` at
# db570fe619). Newer SGLang decodes give later-added fields defaults, so sending fewer keys is safe; sending more
# breaks older ones.
SERVER_INFO_KEYS = (
    "attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype", "follow_bootstrap_room",
    "enable_dsa_cache_layer_split", "prefill_http_port", "target_tp_rank", "target_tp_ranks", "target_cp_ranks",
    "target_pp_ranks", "required_dst_info_num", "required_prefill_response_num",
)

# What fsm-pd adds to a rank: where its signed side channel listens (a zmq address), where and how its KV data
# plane is reached, the KV page layout (``KVLayout.to_dict()``), the node's id, and the instance id of the process
# that registered (a restarted node registers a new one, which is how a decode node tells it from its predecessor).
EXTRA_FIELDS: dict[str, type] = {
    "side_channel": str, "transfer_addr": str, "transfer_backend": str, "kv_layout": dict, "node_id": str,
    "instance": str,
}

ROUTE_QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


class BadRequest(ValueError):
    """A request the server refuses with 400; the message is sent back verbatim."""


def as_int(value: Any, name: str) -> int:
    """An integer as SGLang writes it: a JSON number without fraction, or its decimal text. Booleans are not."""
    if isinstance(value, bool):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
        return int(value.strip())
    raise BadRequest(f"{name} must be an integer, got {_preview(value)}")


def _text(value: Any, name: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT_CHARS:
        raise BadRequest(f"{name} must be a non-empty string of at most {MAX_TEXT_CHARS} characters, "
                         f"got {_preview(value)}")
    return value


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclasses.dataclass(frozen=True)
class RankRegistration:
    """One prefill rank's ``PUT /route`` body. The defaults describe a single-rank prefill node (fsm-pd's usual)."""

    rank_ip: str
    rank_port: int
    page_size: int
    kv_cache_dtype: str | None
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    attn_cp_size: int = 1
    attn_cp_rank: int = 0
    attn_dp_size: int = 1
    attn_dp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    system_dp_size: int = 1
    system_dp_rank: int = 0
    load_balance_method: str = "follow_bootstrap_room"
    enable_dsa_cache_layer_split: bool = False
    prefill_http_port: int | None = None
    side_channel: str | None = None
    transfer_addr: str | None = None
    transfer_backend: str | None = None
    kv_layout: dict | None = None
    node_id: str | None = None
    instance: str | None = None

    @property
    def dp_size(self) -> int:
        # SGLang: DP attention ranks are one server's attention groups; plain DP replicas are whole schedulers.
        return self.attn_dp_size if self.system_dp_size == 1 else self.system_dp_size

    @property
    def dp_group(self) -> int:
        return self.attn_dp_rank if self.system_dp_size == 1 else self.system_dp_rank

    @property
    def key(self) -> tuple[int, int, int, int]:
        """Where the rank sits in the table: (dp group, cp rank, tp rank, pp rank), as ``GET /route`` asks."""
        return self.dp_group, self.attn_cp_rank, self.attn_tp_rank, self.pp_rank

    @property
    def expected_ranks(self) -> int:
        return self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size

    def extras(self) -> dict[str, Any]:
        """fsm-pd's fields that this rank set."""
        return {name: getattr(self, name) for name in EXTRA_FIELDS if getattr(self, name) is not None}

    def rank_info(self) -> dict[str, Any]:
        """The per-rank ``GET /route`` answer: SGLang's ``{rank_ip, rank_port}`` plus the extras this rank set."""
        return {"rank_ip": self.rank_ip, "rank_port": self.rank_port, **self.extras()}

    def to_json(self) -> dict[str, Any]:
        """The registration body: every SGLang field (as SGLang's prefill sends them) plus the extras set."""
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in EXTRA_FIELDS}
        return {**body, **self.extras()}

    @classmethod
    def from_json(cls, data: Any) -> RankRegistration:
        """Check a decoded ``PUT /route`` body; raise ``BadRequest`` naming the first problem found."""
        if not isinstance(data, Mapping):
            raise BadRequest(f"the registration must be a JSON object, got {type(data).__name__}")
        required = ("attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size", "attn_dp_rank",
                    "pp_size", "pp_rank", "system_dp_size", "system_dp_rank", "rank_ip", "rank_port", "page_size",
                    "kv_cache_dtype")
        missing = [name for name in required if name not in data]
        if missing:
            raise BadRequest(f"the registration lacks {', '.join(missing)}")
        ints = {name: as_int(data[name], name) for name in required if name not in ("rank_ip", "kv_cache_dtype")}
        for size, rank in (("attn_tp_size", "attn_tp_rank"), ("attn_cp_size", "attn_cp_rank"),
                           ("attn_dp_size", "attn_dp_rank"), ("pp_size", "pp_rank"),
                           ("system_dp_size", "system_dp_rank")):
            if not 1 <= ints[size] <= MAX_PARALLEL_SIZE:
                raise BadRequest(f"{size} must be in [1, {MAX_PARALLEL_SIZE}], got {ints[size]}")
            if not 0 <= ints[rank] < ints[size]:
                raise BadRequest(f"{rank} must be in [0, {size}={ints[size]}), got {ints[rank]}")
        on_unix = isinstance(data["rank_ip"], str) and data["rank_ip"].startswith("unix:")
        if not (1 <= ints["rank_port"] <= 65535 or (on_unix and ints["rank_port"] == 0)):
            raise BadRequest(f"rank_port must be a TCP port (1..65535), or 0 with a unix:PATH rank_ip, got "
                             f"{ints['rank_port']}")
        if ints["page_size"] < 1:
            raise BadRequest(f"page_size must be at least 1, got {ints['page_size']}")
        http_port = data.get("prefill_http_port")
        extras: dict[str, Any] = {}
        for name, kind in EXTRA_FIELDS.items():
            value = data.get(name)
            if value is None:
                continue
            if kind is dict and not isinstance(value, dict):
                raise BadRequest(f"{name} must be a JSON object, got {_preview(value)}")
            extras[name] = value if kind is dict else _text(value, name)
        return cls(
            rank_ip=_text(data["rank_ip"], "rank_ip"),
            kv_cache_dtype=_text(data["kv_cache_dtype"], "kv_cache_dtype", optional=True),
            load_balance_method=_text(data.get("load_balance_method", "follow_bootstrap_room"),
                                      "load_balance_method"),
            enable_dsa_cache_layer_split=bool(data.get("enable_dsa_cache_layer_split", False)),
            prefill_http_port=None if http_port is None else as_int(http_port, "prefill_http_port"),
            **ints, **extras,
        )


def parse_route_query(params: Mapping[str, str]) -> tuple[int, int, int, int]:
    """The four ``GET /route`` parameters. Absent or empty is SGLang's 400 text; not an integer is a 400 too."""
    if any(not params.get(name) for name in ROUTE_QUERY):
        raise BadRequest("Missing inputs for bootstrap server.")
    dp, cp, tp, pp = (as_int(params[name], name) for name in ROUTE_QUERY)
    return dp, cp, tp, pp


def parse_dp_rank_registration(data: Any) -> tuple[int, int]:
    """``POST /register_dp_rank`` body ``{"bootstrap_room": int, "dp_rank": int}`` → (room, dp rank)."""
    if not isinstance(data, Mapping) or "bootstrap_room" not in data or "dp_rank" not in data:
        raise BadRequest('the body must be {"bootstrap_room": int, "dp_rank": int}')
    room, dp_rank = _room(data["bootstrap_room"], "bootstrap_room"), as_int(data["dp_rank"], "dp_rank")
    if not 0 <= dp_rank < MAX_PARALLEL_SIZE:
        raise BadRequest(f"dp_rank must be in [0, {MAX_PARALLEL_SIZE}), got {dp_rank}")
    return room, dp_rank


def parse_dp_rank_query(data: Any) -> list[int]:
    """``POST /query_dp_ranks`` body ``{"bootstrap_rooms": [int, ...]}`` → the rooms."""
    if not isinstance(data, Mapping) or not isinstance(data.get("bootstrap_rooms"), list):
        raise BadRequest('the body must be {"bootstrap_rooms": [int, ...]}')
    return [_room(room, "bootstrap_rooms[]") for room in data["bootstrap_rooms"]]


def _room(value: Any, name: str) -> int:
    room = as_int(value, name)
    if not 0 <= room < ROOM_LIMIT:
        raise BadRequest(f"{name} must be in [0, 2**64), got {room}")
    return room
