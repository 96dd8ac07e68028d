"""Periodic probes reuse one HTTP client: a client per probe builds a TLS context (about 0.4 MB) that a serving
node's GC policy frees only at a rare full collection, which made a decode node grow 0.7 MB/s (issue 11's soak)."""

from __future__ import annotations

import ssl

from httpx_ssl import unshared
from stub_engine import stub_server

from fsm_pd.bootstrap.client import check_health


def test_heartbeat_probes_build_no_tls_context_each(monkeypatch):
    unshared(monkeypatch)  # the suite's processes share one context (tests/httpx_ssl.py): a node's do not
    built = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or real(*a, **k))
    with stub_server() as (url, _):
        assert check_health(url)  # the first probe may build the shared client
        before = len(built)
        for _ in range(20):
            assert check_health(url)
    assert len(built) == before
