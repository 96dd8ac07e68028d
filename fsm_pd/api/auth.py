"""An optional API key, checked like SGLang's ``--api-key``: ``Authorization: Bearer <key>`` on every route except
the health and metrics probes (load balancers and Prometheus scrape those without credentials)."""

from __future__ import annotations

import hmac
import json

# prefixes: /health_generate is open too, as in SGLang; /readiness and /liveness are the router's probes
OPEN_PATHS = ("/health", "/metrics", "/livez", "/startupz", "/readiness", "/liveness")


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("api_key must be a non-empty string, or None for no key")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" \
                or scope.get("path", "").startswith(OPEN_PATHS):
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", ())).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": "missing or wrong API key (send Authorization: Bearer <key>)",
                                     "type": "UnauthorizedError", "code": 401}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
