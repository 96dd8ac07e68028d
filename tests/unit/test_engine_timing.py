"""SGLang's timing fields in the engines' outputs (``meta_info`` on /generate): the prefill and decode engines give
each room's phases exactly as their journals time them, and ``queue_time``; a colocated engine gives ``queue_time``.
A prefill and a decode engine in one process (real side channel and bootstrap server on 127.0.0.1, or unix sockets
on a host without TCP: ``node_sockets.py``; ``fake`` data plane, real SQLite journals)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from node_sockets import node_sockets
from test_serving_colocated import PAGE_SIZE, PAGES, request, run
from test_transfer_metrics import phase_seconds_from_journal

from fsm_pd.model.loader import load_model
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.types import Bootstrap

PHASE_FIELDS = {"bootstrap": "bootstrap_duration", "waiting": "waiting_duration", "transfer": "transfer_duration"}


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def test_pd_outputs_carry_each_sides_journaled_phases_and_queue_time(model, tmp_path):
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp_path / "p.db"),
                      **node_sockets(tmp_path, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp_path / "d.db"), **node_sockets(tmp_path, "d"))
    try:
        host, port = p.bootstrap_host_port
        req = dataclasses.replace(request("t1", model.tokenizer.encode("time me"), max_new_tokens=3),
                                  bootstrap=Bootstrap(host, port, 4242))

        async def both():
            return await asyncio.gather(generate(p, req), generate(d, req))

        prefill, decode = run(both())
    finally:
        d.close()
        p.close()
    for meta, journal in ((prefill[-1].meta, tmp_path / "p.db"), (decode[-1].meta, tmp_path / "d.db")):
        journaled = phase_seconds_from_journal(journal, 4242)
        for phase, name in PHASE_FIELDS.items():
            assert meta[name] == pytest.approx(journaled[phase], abs=2e-6), (journal.name, name)
        assert meta["queue_time"] >= 0
    # the prefill's queue is part of its WaitingForInput phase (its own prefill not done yet)
    assert prefill[-1].meta["queue_time"] <= prefill[-1].meta["waiting_duration"] + 0.005
    assert decode[0].meta["transfer_duration"] == decode[-1].meta["transfer_duration"]  # the first chunk has it


def test_colocated_outputs_carry_queue_time(model):
    engine = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE)
    try:
        outs = run(generate(engine, request("c1", model.tokenizer.encode("queue me"), max_new_tokens=3)))
    finally:
        engine.close()
    assert 0 <= outs[0].meta["queue_time"] == outs[-1].meta["queue_time"] <= outs[-1].meta["e2e_seconds"]
    assert "transfer_duration" not in outs[-1].meta
