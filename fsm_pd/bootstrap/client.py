"""Client of the bootstrap server (ours or SGLang's): register a prefill rank, find one, probe health.

Retry policy, after SGLang's (``docs/bootstrap.md``):

* ``register_prefill_rank`` tries ``attempts`` times, sleeping ``min(base * 2**k, cap) * U[0.75, 1)`` after the
  k-th failure (SGLang: base 1 s, cap 30 s, 5 tries, 5 s per try). Only what can heal is retried: no answer, a
  timeout, a 5xx. A 4xx (bad token, a malformed or conflicting registration) is final at once. SGLang logs and
  carries on when registration fails for good; here the error is raised, since a prefill node nobody can find
  should not look healthy.
* ``resolve_prefill`` / ``fetch_prefill_layout`` retry a 503 (the prefill server's ranks are still registering), no
  answer or a 5xx every ``interval`` seconds, ``retries`` times after the first try (SGLang's decode: 15 tries 1 s
  apart); a 404 (no such rank) or another 4xx is final. Either way the failure is a ``LookupError`` with the reason.

URLs may be ``http://host:port``, SGLang's bare ``host:port``, or ``unix:PATH`` for a server on a unix socket
(``fsm_pd.net.unix_http``). All calls are synchronous (httpx).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx

from fsm_pd.net import unix_http
from fsm_pd.net.unix_http import http_url
from fsm_pd.net.unix_sockets import is_unix

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0  # SGLang's per-request timeout for every bootstrap call
HEALTH_TIMEOUT_S = 2.0


class BootstrapError(RuntimeError):
    """A write to the bootstrap server failed for good. ``status`` is the last HTTP status, None if none came."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def base_url(url: str) -> str:
    """The server's base URL as this module's clients take it: ``unix:PATH`` as ``unix_http.http_url`` writes it,
    ``host:port`` with ``http://``."""
    url = url.strip().rstrip("/")
    if is_unix(url):
        return http_url(url)
    return url if "://" in url else f"http://{url}"


sleep = time.sleep  # the retries' one clock: a test replaces it and reads the waits instead of timing them


def backoff_delay(attempt: int, base_s: float = 1.0, cap_s: float = 30.0) -> float:
    """Seconds to wait after failed try ``attempt`` (0-based): ``min(base * 2**attempt, cap) * U[0.75, 1)``.
    The jitter keeps the ranks of one server, which all start together, from retrying in step."""
    return min(base_s * 2 ** attempt, cap_s) * random.uniform(0.75, 1.0)


def _auth(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def _retryable(status: int) -> bool:
    return status >= 500  # 503 = not all ranks registered; other 5xx = a server in trouble, maybe restarting


def _describe(response: httpx.Response) -> str:
    text = response.text.strip()
    return f"HTTP {response.status_code}" + (f": {text[:200]}" if text else "")


def _with_retries(request: Callable[[], httpx.Response], *, tries: int, delay: Callable[[int], float],
                  what: str) -> tuple[httpx.Response | None, str]:
    """Call ``request`` until it answers something not worth retrying or the tries run out. Returns the final
    response (None if none came) and a description of the last failure."""
    reason = "no attempt made"
    for attempt in range(tries):
        try:
            response = request()
        except httpx.HTTPError as exc:  # refused, reset, timed out: the server may not be up yet
            response, reason = None, f"{type(exc).__name__}: {exc}"
        else:
            if not _retryable(response.status_code):
                return response, ""
            reason = _describe(response)
        if attempt + 1 < tries:
            wait = delay(attempt)
            log.debug("%s: try %d/%d failed (%s); again in %.2fs", what, attempt + 1, tries, reason, wait)
            sleep(wait)
    return None, reason


def register_prefill_rank(url: str, info: Mapping[str, Any], token: str | None = None, attempts: int = 5, *,
                          timeout_s: float = REQUEST_TIMEOUT_S, backoff_base_s: float = 1.0,
                          backoff_cap_s: float = 30.0) -> None:
    """``PUT /route`` one prefill rank (``RankRegistration.to_json()`` or SGLang's dict); raise ``BootstrapError``
    if it is refused or every attempt fails."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    target = base_url(url) + "/route"
    what = f"registering prefill rank {info.get('rank_ip')}:{info.get('rank_port')} at {target}"
    with unix_http.client(timeout=timeout_s) as client:
        response, reason = _with_retries(lambda: client.put(target, json=dict(info), headers=_auth(token)),
                                         tries=attempts, delay=lambda k: backoff_delay(k, backoff_base_s,
                                                                                       backoff_cap_s), what=what)
    if response is None:
        log.error("%s: gave up after %d attempts; last: %s", what, attempts, reason)
        raise BootstrapError(f"{what}: gave up after {attempts} attempts; last: {reason}")
    if response.status_code != 200:
        log.error("%s: refused with %s", what, _describe(response))
        raise BootstrapError(f"{what}: refused with {_describe(response)}", status=response.status_code)


def deregister_prefill_rank(url: str, info: Mapping[str, Any], token: str | None = None, *,
                            timeout_s: float = 2.0) -> bool:
    """``POST /deregister`` one prefill rank (the body it registered with), once: a draining node must not wait
    long on a bootstrap server that is gone. True when it was removed; False when it was not registered or another
    instance holds it now (both logged); ``BootstrapError`` when the server refused it or could not be reached."""
    target = base_url(url) + "/deregister"
    try:
        response = unix_http.request("POST", target, json=dict(info), headers=_auth(token), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise BootstrapError(f"deregistering at {target}: {type(exc).__name__}: {exc}") from exc
    if response.status_code == 200:
        return True
    if response.status_code in (404, 409):
        log.info("deregistering at %s: %s", target, _describe(response))
        return False
    raise BootstrapError(f"deregistering at {target}: {_describe(response)}", status=response.status_code)


def _lookup(url: str, params: dict[str, int], *, what: str, retries: int, interval: float,
            timeout_s: float) -> dict[str, Any]:
    if retries < 0:
        raise ValueError(f"retries must not be negative, got {retries}")
    target = base_url(url) + "/route"
    with unix_http.client(timeout=timeout_s) as client:
        response, reason = _with_retries(lambda: client.get(target, params=params), tries=retries + 1,
                                         delay=lambda k: interval, what=what)
    if response is None:
        raise LookupError(f"{what} at {target}: gave up after {retries + 1} tries; last: {reason}")
    if response.status_code != 200:
        raise LookupError(f"{what} at {target}: {_describe(response)}")
    try:
        found = response.json()
    except ValueError:
        found = None
    if not isinstance(found, dict):
        raise LookupError(f"{what} at {target}: the answer is not a JSON object: {response.text[:200]!r}")
    return found


def resolve_prefill(url: str, dp_rank: int = 0, cp_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0, *,
                    retries: int = 14, interval: float = 1.0, timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """One prefill rank's entry: ``{"rank_ip", "rank_port"}`` plus the fsm-pd fields it registered
    (``side_channel``, ``transfer_addr``, ``transfer_backend``, ``kv_layout``, ``node_id``). Raises
    ``LookupError`` on a 404 or once ``retries`` retries ``interval`` seconds apart are used up."""
    params = {"prefill_dp_rank": dp_rank, "prefill_cp_rank": cp_rank, "target_tp_rank": tp_rank,
              "target_pp_rank": pp_rank}
    found = _lookup(url, params, what=f"prefill rank dp={dp_rank} cp={cp_rank} tp={tp_rank} pp={pp_rank}",
                    retries=retries, interval=interval, timeout_s=timeout_s)
    if "rank_ip" not in found or "rank_port" not in found:
        raise LookupError(f"the bootstrap server at {base_url(url)} answered without rank_ip/rank_port: {found}")
    return found


def fetch_prefill_layout(url: str, *, retries: int = 14, interval: float = 1.0,
                         timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """The prefill server's layout (SGLang's ``PrefillServerInfo`` keys), asked with all four parameters -1."""
    params = dict.fromkeys(("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"), -1)
    return _lookup(url, params, what="prefill layout", retries=retries, interval=interval, timeout_s=timeout_s)


def register_dp_rank(url: str, room: int, dp_rank: int, token: str | None = None, *,
                     timeout_s: float = REQUEST_TIMEOUT_S) -> None:
    """Tell decode which prefill DP rank took ``room`` (one try, as SGLang's sender does)."""
    target = base_url(url) + "/register_dp_rank"
    try:
        response = unix_http.request("POST", target, json={"bootstrap_room": room, "dp_rank": dp_rank},
                                     headers=_auth(token), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise BootstrapError(f"registering room {room} at {target}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise BootstrapError(f"registering room {room} at {target}: {_describe(response)}",
                             status=response.status_code)


def query_dp_ranks(url: str, rooms: Iterable[int], *, timeout_s: float = REQUEST_TIMEOUT_S) -> dict[int, int]:
    """``{room: dp_rank}`` for the rooms the server knows (unknown or expired rooms are absent)."""
    target = base_url(url) + "/query_dp_ranks"
    try:
        response = unix_http.request("POST", target, json={"bootstrap_rooms": list(rooms)}, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise LookupError(f"querying dp ranks at {target}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise LookupError(f"querying dp ranks at {target}: {_describe(response)}")
    try:
        return {int(room): int(dp_rank) for room, dp_rank in response.json().items()}
    except (ValueError, TypeError, AttributeError):
        raise LookupError(f"querying dp ranks at {target}: not a {{room: dp_rank}} object: "
                          f"{response.text[:200]!r}") from None


def check_health(url: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    """True iff ``GET /health`` answers 200 within ``timeout`` seconds (decode's heartbeat probe)."""
    try:
        return _probe_client().get(base_url(url) + "/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


_probes: httpx.Client | None = None
_probes_lock = threading.Lock()


def _probe_client() -> httpx.Client:
    """One client for every health probe of the process. A client per probe builds a TLS context (about 0.4 MB)
    each second, held in reference cycles that a serving node's GC policy collects rarely: the decode node's RSS grew
    0.7 MB/s over a soak (issue 11)."""
    global _probes
    with _probes_lock:
        if _probes is None:
            _probes = unix_http.client(timeout=HEALTH_TIMEOUT_S)
        return _probes
