"""How the decode node finds the prefill node of a request, and how the prefill node makes itself findable.

A request names its prefill node the SGLang way, ``bootstrap_host``/``bootstrap_port`` (here ``bootstrap_addr``,
``"host:port"``), or, without a bootstrap server, directly by side-channel address (``prefill_addr``). Lookups are
cached per (bootstrap URL, dp rank); the heartbeat drops a URL's entries when its node dies, so a node restarted
behind the same address is looked up afresh (SGLang issue 16903).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from fsm_pd.bootstrap import RankRegistration, register_prefill_rank, resolve_prefill
from fsm_pd.bootstrap.client import base_url


class PrefillResolver:
    def __init__(self, *, retries: int = 14, interval_s: float = 1.0):
        self.retries, self.interval_s = retries, interval_s
        self._cache: dict[tuple[str, int], dict] = {}
        self._lock = threading.Lock()

    def __call__(self, ctx: Mapping[str, Any]) -> dict:
        if "prefill_addr" in ctx:
            return {"prefill_addr": ctx["prefill_addr"], "peer": ctx.get("peer", "prefill")}
        if "bootstrap_addr" not in ctx:
            raise LookupError("the request names neither a bootstrap server (bootstrap_host/bootstrap_port) "
                              "nor a prefill side-channel address")
        url = base_url(str(ctx["bootstrap_addr"]))
        key = (url, int(ctx.get("prefill_dp_rank", 0)))
        with self._lock:
            found = self._cache.get(key)
        if found is None:
            found = resolve_prefill(url, dp_rank=key[1], retries=self.retries, interval=self.interval_s)
            if not found.get("side_channel"):
                raise LookupError(f"the prefill rank registered at {url} has no fsm-pd side channel "
                                  "(is it an fsm-pd prefill node?)")
            with self._lock:
                self._cache[key] = found
        return {"prefill_addr": found["side_channel"], "peer": found.get("node_id", "prefill"), "bootstrap_url": url}

    def forget(self, url: str) -> None:
        with self._lock:
            for key in [k for k in self._cache if k[0] == url]:
                del self._cache[key]


def register_prefill(bootstrap_url: str, *, host: str, side_channel: str, transfer_addr: str, backend: str,
                     layout: dict, node_id: str, http_port: int | None = None, token: str | None = None,
                     attempts: int = 5, backoff_base_s: float = 1.0) -> None:
    """Register this prefill node (one rank) with its bootstrap server, retrying with SGLang's backoff."""
    port = int(side_channel.rsplit(":", 1)[1])
    reg = RankRegistration(rank_ip=host, rank_port=port, page_size=layout["page_size"],
                           kv_cache_dtype=layout["dtype"], prefill_http_port=http_port, side_channel=side_channel,
                           transfer_addr=transfer_addr, transfer_backend=backend, kv_layout=layout, node_id=node_id)
    register_prefill_rank(bootstrap_url, reg.to_json(), token=token, attempts=attempts,
                          backoff_base_s=backoff_base_s)
