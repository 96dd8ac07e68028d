"""``PDPair`` (``--pd-front direct``): what it submits to each engine of ``--role pd`` for one request, as the built-in
router would have sent them: one new room for both, the prefill engine's bootstrap server, the policy's route; a
refused decode aborts the prefill's room; an abort reaches both. The engines here record what they get (the real
ones, behind a node's app: ``tests/integration/test_pd_one_process.py``, setup ``pool-direct``)."""

from __future__ import annotations

import pytest

from fsm_pd.cli.pd_pair import PDPair
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.router.policy import PolicySettings
from fsm_pd.serving.types import EngineError, GenerateRequest

BOOTSTRAP = "unix:/tmp/links/prefill.bootstrap.sock"


class Recording:
    def __init__(self, role: str, refuse: bool = False):
        self.role, self.refuse = role, refuse
        self.model_name, self.model, self.max_context = "tiny", None, 4096
        self.submitted: list[GenerateRequest] = []
        self.aborted: list[tuple] = []

    def submit(self, request, stream):
        if self.refuse:
            raise EngineError("no room", 400)
        self.submitted.append(request)

    def abort(self, rid, reason=None, status=499, *, room=None):
        self.aborted.append((rid, room))
        return True

    def health(self):
        return None

    def info(self):
        return {"role": self.role, "transfer_backend": "pool"}

    def flush_cache(self):
        return (self.role == "decode" or not self.refuse), f"{self.role} flushed"


def request(rid: str, tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, list(range(3, 3 + tokens)), SamplingParams(temperature=0.0, max_new_tokens=4), seed=7)


def pair(mode: str, refuse: bool = False) -> PDPair:
    return PDPair(Recording("prefill"), Recording("decode", refuse), PolicySettings(mode, 256), BOOTSTRAP)


def test_a_pd_request_goes_to_both_engines_with_one_new_room_and_its_route():
    p = pair("auto")
    p.submit(request("long", 300), stream=object())
    p.submit(request("long2", 300), stream=object())
    (pre, pre2), (dec, dec2) = p.prefill.submitted, p.decode.submitted
    assert dec2.bootstrap == pre2.bootstrap
    assert pre.bootstrap == dec.bootstrap and pre.bootstrap.room != pre2.bootstrap.room
    assert (dec.bootstrap.host, dec.bootstrap.port, dec.bootstrap.local) == (BOOTSTRAP, 0, False)
    assert dec.route == pre.route == {"path": "pd", "reason": "300 prompt tokens > 256"}
    assert (pre.stream, dec.input_ids, dec.seed) == (False, list(range(3, 303)), 7)
    assert p.routed == {"pd": 2, "local": 0}
    (family,) = p.collect()  # /metrics: the router's family
    assert family.name == "fsm_pd_router_routed"
    assert {s.labels["path"]: s.value for s in family.samples if s.name.endswith("_total")} == {"pd": 2, "local": 0}


@pytest.mark.parametrize(("mode", "tokens", "path"), [("auto", 256, "local"), ("never", 900, "local"),
                                                      ("always", 8, "pd")])
def test_the_policy_decides_from_the_prompts_exact_length(mode, tokens, path):
    p = pair(mode)
    p.submit(request("r", tokens), stream=object())
    (dec,) = p.decode.submitted
    assert dec.route["path"] == path and dec.bootstrap.local == (path == "local")
    assert len(p.prefill.submitted) == (path == "pd")


def test_a_request_the_decode_engine_refuses_ends_its_prefill_room_at_once():
    p = pair("always", refuse=True)
    with pytest.raises(EngineError):
        p.submit(request("refused", 20), stream=object())
    (pre,) = p.prefill.submitted
    assert p.prefill.aborted == [("refused", pre.bootstrap.room)]
    assert p.routed == {"pd": 0, "local": 0}


def test_an_abort_reaches_both_engines():
    p = pair("always")
    assert p.abort("gone") is True
    assert p.prefill.aborted == p.decode.aborted == [("gone", None)]


def test_a_cache_flush_is_both_engines_and_succeeds_only_if_both_do():
    assert pair("always").flush_cache() == (True, "prefill: prefill flushed; decode: decode flushed")
    p = pair("always")
    p.prefill.refuse = True
    assert p.flush_cache()[0] is False
