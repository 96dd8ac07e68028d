"""Rooms a restart failed leave memory: a node that comes back fails the rooms its journal left unfinished, and once
they are Failed nothing holds them (issue 11: "rooms failed at a restart stay in memory for good")."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from polling import until

from fsm_pd.model.sampling import SamplingParams
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.types import Bootstrap, GenerateRequest, RequestStream


def request(rid: str, bootstrap: Bootstrap) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=[5, 6, 7, 8, 9], sampling=SamplingParams(max_new_tokens=4), seed=1,
                           bootstrap=bootstrap)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_rooms_failed_by_a_restart_are_forgotten(role, model, tmp_path):
    partner = PrefillEngine(model, num_pages=64, page_size=4, backend="fake", journal=str(tmp_path / "partner.db"))
    bootstrap = Bootstrap(*partner.bootstrap_host_port, room=0)
    journal = str(tmp_path / f"{role}.db")

    def start():
        if role == "prefill":
            return PrefillEngine(model, num_pages=64, page_size=4, backend="fake", journal=journal,
                                 bootstrap_port=None)
        return DecodeEngine(model, num_pages=64, page_size=4, backend="fake", journal=journal, secret=partner.secret)

    loop = asyncio.new_event_loop()
    try:
        engine = start()
        for room in (11, 12, 13):  # requests that never finish: no partner ever sees them
            engine.submit(request(f"r{room}", dataclasses.replace(bootstrap, room=room)),
                          RequestStream(f"r{room}", loop))
        assert until(lambda: sum(engine.info()["rooms_by_state"].values()) == 3)
        engine.close()  # the process goes away with three rooms open

        engine = start()
        try:
            assert sorted(engine.manager.recovered) == [11, 12, 13]
            assert until(lambda: engine.info()["rooms_by_state"] == {}), engine.info()["rooms_by_state"]
            assert engine.leak_counters()["rooms_open"] == 0
        finally:
            engine.close()
    finally:
        partner.close()
        loop.close()
