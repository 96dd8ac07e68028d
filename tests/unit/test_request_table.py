"""The engines' ``RequestTable`` on its own: requests by (rid, room), and the bound on remembered early aborts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from fsm_pd.model.sampling import SamplingParams
from fsm_pd.serving.request_table import ABORTS_REMEMBERED, RequestTable
from fsm_pd.serving.types import Bootstrap, EngineError, GenerateRequest, RequestStream


@dataclass(eq=False)
class Live:
    """What the table reads of a ``Sequence``."""

    request: GenerateRequest
    stream: RequestStream
    cancelled: bool = False

    @property
    def identity(self) -> tuple[str, int | None]:
        return self.request.identity


def live(rid: str, room: int | None) -> Live:
    boot = Bootstrap("127.0.0.1", 8998, room) if room is not None else None
    request = GenerateRequest(rid, [1], SamplingParams(), seed=0, bootstrap=boot)
    return Live(request, RequestStream(rid, asyncio.new_event_loop()))


def test_only_the_last_aborts_that_found_nothing_are_remembered():
    table = RequestTable()
    for room in range(ABORTS_REMEMBERED + 1):
        assert table.cancel("r", room) == []
    table.add(live("r", 0))  # the oldest was forgotten: a request in its room is taken
    with pytest.raises(EngineError) as err:
        table.add(live("r", 1))
    assert err.value.status == 499
    table.add(live("r", 1))  # the refusal used the memory up (a node would 409 a room it had anyway)
    assert len(table) == 2


def test_a_colocated_request_is_its_rid():
    table = RequestTable()
    table.add(live("c", None))
    with pytest.raises(EngineError) as err:
        table.add(live("c", None))
    assert err.value.status == 400 and "already running" in str(err.value)
    assert [s.identity for s in table.cancel("c")] == [("c", None)] and len(table) == 0
