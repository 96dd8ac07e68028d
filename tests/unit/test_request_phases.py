"""``fsm_pd_request_phase_seconds``: each node times the parts of a request's time to first token that are its own
(queue and prefill on prefill and colocated nodes, admission on a decode node, first_token everywhere), once per
request, and the parts fit inside the whole."""

from __future__ import annotations

import re

from prometheus_client import generate_latest
from test_serving_colocated import PAGE_SIZE, PAGES, ids_of, request, run
from test_serving_pd import model, pd, pd_request, through_pd  # noqa: F401 (fixtures)

from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def phases(engine) -> dict[str, tuple[float, float]]:
    """phase -> (count, sum) from the engine's own registry."""
    text = generate_latest(engine.registry).decode()
    found: dict[str, list[float]] = {}
    for kind, phase, value in re.findall(r'fsm_pd_request_phase_seconds_(count|sum)\{[^}]*phase="(\w+)"[^}]*\} (\S+)',
                                         text):
        found.setdefault(phase, [0.0, 0.0])[kind == "sum"] = float(value)
    return {phase: tuple(v) for phase, v in found.items()}


def test_a_colocated_request_is_timed_in_queue_prefill_and_first_token(model):  # noqa: F811
    engine = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE)
    try:
        for i in range(3):
            assert ids_of(run(generate(engine, request(f"c{i}", PROMPT, max_new_tokens=3))))
        got = phases(engine)
    finally:
        engine.close()
    assert {p: c for p, (c, _) in got.items()} == {"queue": 3, "prefill": 3, "admission": 0, "first_token": 3}
    assert got["queue"][1] + got["prefill"][1] <= got["first_token"][1]
    assert got["prefill"][1] > 0


def test_pd_times_queue_and_prefill_on_the_prefill_node_and_admission_on_the_decode_node(pd):  # noqa: F811
    p, d = pd
    before_p, before_d = phases(p), phases(d)
    for i in range(2):
        run(through_pd(p, d, pd_request(p, f"pd{i}", PROMPT, max_new_tokens=3)))
    after_p, after_d = phases(p), phases(d)

    def counts(after, before):
        return {k: after[k][0] - before.get(k, (0, 0))[0] for k in after}

    assert counts(after_p, before_p) == {"queue": 2, "prefill": 2, "admission": 0, "first_token": 2}
    assert counts(after_d, before_d) == {"queue": 0, "prefill": 0, "admission": 2, "first_token": 2}
    # the decode node's first token comes after the prefill node's: it waits for the prompt and the transfer
    assert after_d["first_token"][1] - before_d["first_token"][1] > after_p["prefill"][1] - before_p["prefill"][1]

