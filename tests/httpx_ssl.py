"""One SSL context for every httpx client a test process makes.

httpx makes an SSL context for each client, reading every CA certificate of the system into it (26 ms of CPU here),
and so for each ``httpx.get()`` or ``httpx.post()``, which makes a client for the one request. The tests make
thousands of those (a node's /health polled while it starts, the fault rig's one-request client, /server_info
read in loops), all over plain HTTP on loopback, where the context is never used: three integration modules made
976 of them. ``share_one_ssl_context`` has httpx make the default one once and hand it to every client that asks
for the default; a client given its own settings (``verify=False``, a context of its own) gets what it asked for.
Only the processes that run tests call it (``conftest.py``); the servers they start are left as they are. A test of
how many contexts the code makes (``test_probe_memory.py``) has httpx make one per client again (``unshared``).
"""

from __future__ import annotations

import functools


def share_one_ssl_context() -> bool:
    """Make httpx's default SSL context once per process. False, and nothing changed, where this httpx makes its
    contexts elsewhere than ``httpx._transports.default.create_ssl_context`` (the tests are then only slower)."""
    try:
        from httpx._transports import default
    except ImportError:
        return False
    make = getattr(default, "create_ssl_context", None)
    if make is None or getattr(make, "shared", False):
        return make is not None
    made_once = functools.cache(make)

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None and trust_env is True:
            return made_once()
        return make(verify=verify, cert=cert, trust_env=trust_env)

    create_ssl_context.shared, create_ssl_context.original = True, make
    default.create_ssl_context = create_ssl_context
    return True


def unshared(monkeypatch) -> None:
    """For this test: httpx makes an SSL context per client again, as in a process that does not run tests."""
    from httpx._transports import default

    monkeypatch.setattr(default, "create_ssl_context",
                        getattr(default.create_ssl_context, "original", default.create_ssl_context))
