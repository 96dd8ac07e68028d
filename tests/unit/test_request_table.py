"""The engines' ``RequestTable`` on its own: requests by (rid, room), and the bound on remembered early aborts."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from fsm_pd.model.sampling import SamplingParams
from fsm_pd.serving.request_table import ABORTS_REMEMBERED, RequestTable
from fsm_pd.serving.types import Bootstrap, EngineError, GenerateRequest


class Pushed(list):
    """A stream that keeps what is pushed to it."""

    push = list.append


@dataclass(eq=False)
class Live:
    """What the table reads of a ``Sequence``."""

    request: GenerateRequest
    stream: Pushed = field(default_factory=Pushed)
    cancelled: bool = False

    @property
    def identity(self) -> tuple[str, int | None]:
        return self.request.identity


def live(rid: str, room: int | None) -> Live:
    boot = Bootstrap("127.0.0.1", 8998, room) if room is not None else None
    request = GenerateRequest(rid, [1], SamplingParams(), seed=0, bootstrap=boot)
    return Live(request)


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
    table, first = RequestTable(), live("c", None)
    table.add(first)
    with pytest.raises(EngineError) as err:
        table.add(live("c", None))
    assert err.value.status == 400 and "already running" in str(err.value)
    assert table.cancel("c", reason="gone") == [first] and len(table) == 0
    assert first.cancelled and [(str(e), e.status) for e in first.stream] == [("request c gone", 499)]
