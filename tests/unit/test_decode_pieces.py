"""The decode handler's pulls of a resharded room (``effects/room_pull.py``, ``pulls.py``), piece by piece, over
stub ports.

A room between different tensor-parallel sizes is one transfer of several pieces. Whatever order the pieces land or
fail in, and wherever the room's ``FreePages`` falls among them: every landed array is let go exactly once, the
room's pull reports once (``pulled`` with every piece in plan order, or ``error`` naming the first piece that
failed), and nothing stays pending.
"""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_pd.effects.decode import DecodeEffects
from fsm_pd.effects.faults import Faults
from fsm_pd.machines.effect_types import FreePages, Pull, Scatter
from fsm_pd.transport.backends.base import TransferFailed
from fsm_pd.transport.reshard import piece_uuid, plan_between

P_LAYOUT = {"num_layers": 2, "page_size": 4, "kv_heads": 4, "head_dim": 8, "dtype": "float32", "num_pages": 64}
D_LAYOUT = {**P_LAYOUT, "tp": 4, "shard_axis": "tp"}  # P on one device, D on four: four pieces


class Array:
    def __init__(self, name):
        self.name, self.nbytes, self.shape = name, 100, (2, 1)


class Stubs:
    def __init__(self):
        self.events, self.pulls, self.discarded, self.scattered, self.released = [], {}, [], [], []

    # node
    def submit(self, room, trigger, payload):
        self.events.append((trigger, payload))

    # puller
    def pull(self, address, uuid, page_count, timeout_s, *, done, on_progress=None, delay_s=0.0, piece=None):
        self.pulls[piece.index] = (uuid, done)

    # model executor: jobs run at once
    def run(self, job):
        future = Future()
        try:
            future.set_result(job(None))
        except Exception as exc:  # noqa: BLE001
            future.set_exception(exc)
        return future

    # kv: a pool whose scatters copy KV, so they go through the model executor
    checksum_algorithm = "crc32c"
    on_model_thread = True

    def stream(self, pages):
        return None

    def scatter(self, owner, pieces, pages, stream, plan):
        self.scattered.append([p.name for p in pieces])

    def discard(self, array):
        self.discarded.append(array.name)


def handler(stubs: Stubs) -> DecodeEffects:
    model = SimpleNamespace(submit=stubs.run)
    admission = SimpleNamespace(release=lambda node, room: stubs.released.append(room))
    return DecodeEffects(layout=D_LAYOUT, channel=None, resolver=None, admission=admission, puller=stubs,
                         model=model, kv=stubs, faults=Faults(role="decode"))


def room(uuid: int = 1000):
    ctx = {"pages": [5, 6], "page_count": 2, "peer_layout": P_LAYOUT, "transfer_addr": "tcp://127.0.0.1:1",
           "uuid": uuid, "deadlines": {"transfer": 5.0}}
    return SimpleNamespace(room=9, ctx=ctx, state="Transferring", reason=None)


PLAN = plan_between(P_LAYOUT, D_LAYOUT)


@settings(max_examples=300, deadline=None)
@given(outcomes=st.lists(st.booleans(), min_size=len(PLAN.pieces), max_size=len(PLAN.pieces)),
       order=st.permutations(range(len(PLAN.pieces))), free_at=st.none() | st.integers(0, len(PLAN.pieces)))
def test_every_piece_is_let_go_once_whatever_the_order(outcomes, order, free_at):
    stubs = Stubs()
    effects = handler(stubs)
    r = room()
    effects.pull(stubs, r, Pull())
    assert {i: uuid for i, (uuid, _) in stubs.pulls.items()} == {p.index: piece_uuid(1000, p.index)
                                                                 for p in PLAN.pieces}
    landed = []
    for step, index in enumerate(order):
        if step == free_at:
            effects.free_pages(stubs, r, FreePages())
        _, done = stubs.pulls[index]
        if outcomes[index]:
            array = Array(f"piece{index}")
            landed.append(array.name)
            done(array, None)
        else:
            done(None, TransferFailed(f"piece {index} broke"))
    triggers = [trigger for trigger, _ in stubs.events]
    failed_first = next((i for s, i in enumerate(order) if not outcomes[i] and (free_at is None or s < free_at)),
                        None)
    if free_at is None and all(outcomes):
        assert triggers == ["pulled"]
        assert stubs.events[0][1]["bytes"] == 100 * len(PLAN.pieces)
        assert [piece[:2] for piece in stubs.events[0][1]["pieces"]] == [[p.src, p.dst] for p in PLAN.pieces]
        effects.scatter(stubs, r, Scatter())
        assert stubs.scattered == [[f"piece{p.index}" for p in PLAN.pieces]]  # in plan order, whatever the arrival
        assert triggers + ["scattered"] == [t for t, _ in stubs.events]
    elif free_at is None or failed_first is not None:
        assert "pulled" not in triggers
        first_error = next(p for t, p in stubs.events if t == "error")
        assert first_error["reason"].startswith(f"pull failed: piece {failed_first} (prefill shard 0 -> decode shard "
                                                f"{failed_first}): piece {failed_first} broke")
    if free_at is not None and free_at >= len(order):
        effects.free_pages(stubs, r, FreePages())
    if free_at is None and not all(outcomes):
        effects.free_pages(stubs, r, FreePages())  # the failed room frees its pages
    assert sorted(stubs.discarded) == sorted(landed), "every landed piece let go exactly once"
    assert effects.pending == {} and effects.pulled == {}
