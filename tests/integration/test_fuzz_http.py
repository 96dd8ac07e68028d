"""Fuzzing the HTTP APIs from their own OpenAPI schema with schemathesis: valid and invalid requests, generated per
operation, sent in process (ASGI) to an engine server over the stub engine (colocated and prefill), to the PD router
(whose workers are stub servers on 127.0.0.1), and to a server over the real tiny colocated engine.

The property: whatever a client sends, the answer is never a 5xx and the app never raises. Example counts are bounded
so the file runs in a minute or two; ``FSM_PD_FUZZ_EXAMPLES`` raises them for a longer hunt (and
``FSM_PD_FUZZ_RANDOM=1`` draws new examples instead of the fixed, reproducible ones).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import schemathesis  # the test extra's, as hypothesis: missing, this module fails to collect rather than skip unseen
from hypothesis import HealthCheck, settings
from stub_engine import StubEngine

from fsm_pd.api import AppServer, create_app
from fsm_pd.router import create_router_app
from fsm_pd.router.policy import CLASSIC_PD

GenerationMode = schemathesis.GenerationMode

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EXAMPLES = int(os.environ.get("FSM_PD_FUZZ_EXAMPLES", "30"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=os.environ.get("FSM_PD_FUZZ_RANDOM") != "1",
                suppress_health_check=list(HealthCheck), database=None, print_blob=True)
# Fuzzing the real model is slower per example (a new prompt length can mean a compile): fewer examples.
MODEL_FUZZ = settings(FUZZ, max_examples=max(EXAMPLES // 3, 5))


def fuzzable(app) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    # POST /drain works: the server then answers every later generation request 503 (draining), by design
    return schema.exclude(path="/drain")


def assert_no_server_error(case, timeout_s: float = 10.0) -> None:
    # in process: an exception the app did not turn into an answer is raised here
    response = case.call(timeout=timeout_s)
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path} -> {response.status_code}\n"
        f"body: {case.body!r}\nquery: {case.query!r}\nanswer: {response.text[:500]}")


# ---- engine servers over the stub engine -------------------------------------------------------------------------

colocated_engine = StubEngine()
colocated = fuzzable(create_app(colocated_engine, colocated_engine.tokenizer, health_timeout_s=5))
prefill_engine = StubEngine(role="prefill")
prefill = fuzzable(create_app(prefill_engine, prefill_engine.tokenizer, bootstrap_port=8998, health_timeout_s=5))


@colocated.parametrize()
@FUZZ
def test_colocated_stub_server_never_answers_5xx(case):
    assert_no_server_error(case)


@prefill.parametrize()
@FUZZ
def test_prefill_stub_server_never_answers_5xx(case):
    assert_no_server_error(case)


# ---- the PD router, its workers real stub servers on 127.0.0.1 ---------------------------------------------------

_workers = contextlib.ExitStack()
router_prefill, router_decode = StubEngine(role="prefill"), StubEngine(role="decode")


def _router_app():
    p = _workers.enter_context(AppServer(create_app(router_prefill, router_prefill.tokenizer, bootstrap_port=1)))
    d = _workers.enter_context(AppServer(create_app(router_decode, router_decode.tokenizer)))
    return create_router_app([(p.url, 1)], [d.url], request_timeout_s=30, pd_policy=CLASSIC_PD)


router = schemathesis.pytest.from_fixture("router_schema")


@pytest.fixture(scope="module")
def router_schema():
    try:
        yield fuzzable(_router_app())
    finally:
        _workers.close()


@router.parametrize()
@FUZZ
def test_router_never_answers_5xx(case):
    assert_no_server_error(case)


# ---- the real tiny colocated engine ------------------------------------------------------------------------------

tiny = schemathesis.pytest.from_fixture("tiny_schema")


@pytest.fixture(scope="module")
def tiny_schema():
    from fsm_pd.model.loader import load_model
    from fsm_pd.serving.colocated_engine import ColocatedEngine

    model = load_model("tiny")
    engine = ColocatedEngine(model, num_pages=32, page_size=16)
    try:
        yield fuzzable(create_app(engine, model.tokenizer, model_name="tiny", health_timeout_s=30))
    finally:
        engine.close()


@tiny.parametrize()
@MODEL_FUZZ
def test_tiny_colocated_engine_server_never_answers_5xx(case):
    # A generated best_of / n fans out to up to 20 copies, each batch size a new compile on a busy 2-core machine
    assert_no_server_error(case, timeout_s=120.0)
