"""The KV checksum catches corrupted KV, and no corrupted token is served (issue 32).

A prefill and a decode engine in one process over the real ``tcp`` data plane (P sends straight from its pool under
the lease), three ways the KV can go wrong between P's prefill and D's first decode step:

* (a) a byte flipped on the wire: ``FSM_PD_FAULT_CORRUPT_PULL``'s hook (``Faults.corrupting``) on D;
* (b) a page of D's pool overwritten after the handoff wrote it, before the request decodes (by another job on D's
  model thread, queued behind the writes of a streamed handoff: D then cannot use the checksum it took as it wrote);
* (c) a page of P's pool reused (another request's KV written into it by the next job on P's model thread) while its
  send from the pool is under way.

With the check on (both sides) the room fails with ``kv checksum mismatch``, D recomputes the prompt, and the tokens
served are the undisturbed run's. With it off on D (its PREPARE says so, and P then sums nothing) the same
corruption goes through unnoticed: the request is served from KV that is not what P computed. The test sees that with
its own look at both pools (``Look``), independent of the handlers' decision.
"""

from __future__ import annotations

import os
from unittest import mock

import jax
import numpy as np
import pytest
from node_sockets import node_sockets
from on_chip import engines_on_cpu
from test_serving_colocated import PAGE_SIZE, PAGES, ids_of, run
from test_serving_pd import assert_idle, pd_request
from test_transfer_recompute import both, final_rows

from fsm_pd.effects.faults import FaultConfig, Faults
from fsm_pd.kernels.kv_checksum import ALGORITHM_ENV
from fsm_pd.kernels.kv_hash import ALGORITHM as DEVICE_HASH
from fsm_pd.model.loader import load_model
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.store import read_journal
from fsm_pd.store.replay import CHECKSUM_EXPLAINED, replay
from fsm_pd.store.roles import RECORD_ROLES
from fsm_pd.transport.reshard import plan_between

# A node sums its KV (kernels/kv_checksum.py) only where its pool is on the CPU: on a TPU host these tests skip.
pytestmark = engines_on_cpu("the KV checksum is taken")

PROMPTS = [[(5 * i + j) % 200 + 1 for j in range(n)] for i, n in enumerate((9, 21, 30))]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


class Look:
    """A pool-operations port with the test's eyes on it: what P's pages held when the KV was final (``clean``),
    what D's pages hold after the handoff's writes (``landed``), and the corruption of case (b) or (c)."""

    def __init__(self, kv, layout: dict, model):
        self.kv, self.plan, self.model = kv, plan_between(layout, layout), model
        self.clean: list = []
        self.landed: list = []
        self.overwrite = False  # overwrite the room's first page after the real operation, in the same job
        self.streams = True  # False: D writes each handoff whole after its pull, never as it lands

    def stream(self, pages):
        return self.kv.stream(pages) if self.streams else None

    def __getattr__(self, name):
        return getattr(self.kv, name)

    def publish_while_gathering(self, owner, transfer, uuid, pages, hold_timeout_s, on_published):
        assert transfer.sends_pages and owner.lease is not None  # the send from the pool, not a gather
        self.clean.append(self.kv.sent_checksum(owner, pages, self.plan))
        self.kv.publish_while_gathering(owner, transfer, uuid, pages, hold_timeout_s, on_published)
        if self.overwrite:  # the next job (a prefill reusing the page) writes another request's KV into it
            self.model.submit(lambda owner: overwrite(owner, pages[0]))

    def gather(self, owner, pages, plan):
        """A backend that does not send from the pool (``device``) copies the room's pages out in this job."""
        staging = self.kv.gather(owner, pages, plan)
        self.clean.append(self.kv.sent_checksum(owner, pages, self.plan))
        if self.overwrite:  # the next job reuses the page: after the copy, so it cannot reach D
            self.model.submit(lambda owner: overwrite(owner, pages[0]))
        return staging

    def complete_stream(self, stream, staging):
        streamed = self.kv.complete_stream(stream, staging)
        if streamed and self.overwrite:  # another job, after the streamed writes and before the request decodes
            self.model.submit(lambda owner, pages=stream.pages: overwrite(owner, pages[0]))
        return streamed

    def scatter(self, owner, pieces, pages, stream, plan):
        self.kv.scatter(owner, pieces, pages, stream, plan)
        if self.overwrite and stream is None:  # written whole, in this job: overwritten after it, before decoding
            overwrite(owner, pages[0])
        self.landed.append(self.kv.received_checksum(owner, pages, plan))


def overwrite(owner, page: int) -> None:
    """Write other KV into ``page`` of every layer of ``owner.pool`` (on the model thread: we are in its job)."""
    layers = []
    for layer in owner.pool:
        host = np.array(layer)
        host[page] = np.random.default_rng(page).standard_normal(host[page].shape).astype(host.dtype) * 4
        layers.append(jax.device_put(host, layer.sharding))
    owner.pool = type(owner.pool)(layers)


@pytest.fixture(scope="module", params=["on", "off", f"on-{DEVICE_HASH}", f"on-{DEVICE_HASH}@device"])
def pair(request, model, tmp_path_factory):
    """P with the checksum on; D with it ``on`` or ``off``; tcp between them; both pools watched. ``on-kvmix32``:
    both nodes checksum with the device hash (``kernels/kv_hash.py``, what a pool on an accelerator uses) instead of
    crc32c, here on the CPU. ``@device``: the ``device`` backend instead of tcp (two engines of one process, what
    ``--role pd`` runs on a TPU host)."""
    param, _, backend = request.param.partition("@")
    setting, _, algorithm = param.partition("-")
    tmp = tmp_path_factory.mktemp(f"corrupt-{param}-{backend or 'tcp'}")
    backend = backend or "tcp"
    with mock.patch.dict(os.environ, {ALGORITHM_ENV: algorithm}):  # read as each node starts
        # no prefix cache on P: a page overwritten in case (c) must not be served again from the cache
        p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend=backend, journal=str(tmp / "p.db"),
                          radix_cache=False, **node_sockets(tmp, "p", bootstrap=True))
        d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend=backend, secret=p.secret,
                         journal=str(tmp / "d.db"), kv_checksum=setting == "on", **node_sockets(tmp, "d"))
    for node in (p, d):
        assert node.manager.effects.kv.checksum_algorithm == (algorithm or "crc32c")
    p.manager.effects.kv = Look(p.manager.effects.kv, p.manager.effects.layout, p.manager.model)
    d.manager.effects.kv = Look(d.manager.effects.kv, d.manager.effects.layout, d.manager.model)
    yield setting, p, d
    d.close()
    p.close()


def serve(p, d, tag: str) -> tuple[list, list]:
    """Each prompt through the pair, one at a time; the decode node's answers and the requests."""
    requests = [pd_request(p, f"{tag}-{i}", x, max_new_tokens=10) for i, x in enumerate(PROMPTS)]
    answers = []
    for req in requests:
        prefill_out, decode_out = run(both(p, d, req))
        assert not isinstance(decode_out, BaseException), decode_out
        answers.append(decode_out)
    return answers, requests


def checked(p, d, tag: str) -> tuple[list, list]:
    """The undisturbed greedy tokens (their handoffs verified, on D's side too), then the watch lists cleared."""
    p_look, d_look = p.manager.effects.kv, d.manager.effects.kv
    p_look.clean.clear()
    d_look.landed.clear()
    answers, _ = serve(p, d, tag)
    assert p_look.clean == d_look.landed  # nothing disturbed: D's pages hold what P computed
    p_look.clean.clear()
    d_look.landed.clear()
    return [ids_of(a) for a in answers], [a[-1].meta.get("kv_recompute") for a in answers]


def assert_outcome(setting, p, d, want, answers, requests):
    p_look, d_look = p.manager.effects.kv, d.manager.effects.kv
    assert len(p_look.clean) == len(d_look.landed) == len(PROMPTS)
    # what D's pages held after the handoff is not what P computed: the corruption reached D's pool
    assert all(clean != landed for clean, landed in zip(p_look.clean, d_look.landed, strict=True))
    rooms = {r.bootstrap.room for r in requests}
    last = final_rows(d.manager.journal.url, rooms)
    recomputes = [a[-1].meta.get("kv_recompute") for a in answers]
    if setting == "on":  # caught: the room failed with its own reason, D recomputed, the tokens are the clean ones
        assert [ids_of(a) for a in answers] == want
        assert all(r is not None and "kv checksum mismatch: piece 0 layer" in r["reason"] for r in recomputes)
        assert {row.dst for row in last.values()} == {"Failed"}
        assert all(row.event["reason"].startswith("kv checksum mismatch") for row in last.values())
        mismatches = d.manager.metrics.registry.get_sample_value("fsm_pd_kv_checksums_total",
            {"role": "decode", "node": "decode-0", "outcome": "mismatch"})
        assert mismatches >= len(PROMPTS)
        for journal in (d.manager.journal.url, p.manager.journal.url):  # replay names and explains it on both sides
            reports = [r for r in replay(read_journal(journal)).rooms  # the rooms, not the recompute records
                       if r.room in rooms and r.role not in RECORD_ROLES]
            assert len(reports) == len(PROMPTS) and all(CHECKSUM_EXPLAINED in r.why for r in reports)
    else:  # unnoticed: every room succeeded and nothing was recomputed, from KV that is not P's
        assert recomputes == [None] * len(PROMPTS)
        assert {row.dst for row in last.values()} == {"Success"}
    assert_idle(p, d)


@pytest.fixture(params=["streamed", "whole"])
def written(request, pair):
    """How D writes the pulled KV: ``streamed`` as it lands (the fault flips a byte in the landed host bytes, before
    the stream writes them), or ``whole`` after the pull (the fault flips it in the pulled array, on its device: how
    it acts on every backend, ``Faults.Corruption``)."""
    d = pair[2]
    d.manager.effects.kv.streams = request.param == "streamed"
    yield request.param
    d.manager.effects.kv.streams = True


def test_a_byte_flipped_on_the_wire(pair, written):
    setting, p, d = pair
    want, recomputed = checked(p, d, f"wire-clean-{written}")
    assert recomputed == [None] * len(PROMPTS)
    d.manager.effects.faults = Faults(FaultConfig(corrupt_pull=1.0), role="decode")
    try:
        answers, requests = serve(p, d, f"wire-{written}")
    finally:
        injected = d.manager.effects.faults.counters().get("corrupt_pull", 0)
        d.manager.effects.faults = Faults(role="decode")
    assert injected >= len(PROMPTS)
    assert_outcome(setting, p, d, want, answers, requests)


def test_a_page_of_the_decode_pool_overwritten_before_decoding(pair):
    setting, p, d = pair
    want, _ = checked(p, d, "d-pool-clean")
    d.manager.effects.kv.overwrite = True
    try:
        answers, requests = serve(p, d, "d-pool")
    finally:
        d.manager.effects.kv.overwrite = False
    assert_outcome(setting, p, d, want, answers, requests)


def test_a_prefill_page_reused_while_its_send_from_the_pool_runs(pair):
    setting, p, d = pair
    want, _ = checked(p, d, "p-pool-clean")
    p.manager.effects.kv.overwrite = True
    # D pulls 0.3 s after READY: the page is reused before the stream reads it (else a small KV could leave first)
    d.manager.effects.faults = Faults(FaultConfig(pull_delay_s=0.3), role="decode")
    try:
        answers, requests = serve(p, d, "p-pool")
    finally:
        p.manager.effects.kv.overwrite = False
        d.manager.effects.faults = Faults(role="decode")
    if not p.manager.effects.transfer.sends_pages:
        # the device backend copies the room's pages out in P's publishing job: a reuse after it cannot reach D
        assert [ids_of(a) for a in answers] == want
        assert [a[-1].meta.get("kv_recompute") for a in answers] == [None] * len(PROMPTS)
        assert p.manager.effects.kv.clean == d.manager.effects.kv.landed
        assert_idle(p, d)
        return
    assert_outcome(setting, p, d, want, answers, requests)


class Unsummed(Look):
    """P's pool as on an accelerator: its KV cannot be summed on the host (``sent_checksum`` gives None)."""

    summed = False

    def sent_checksum(self, owner, pages, plan):
        return None


def test_a_pool_that_cannot_be_summed_announces_and_publishes_no_checksum(pair):
    """Nothing summed, nothing sent: READY names no checksum and no entry follows the KV, and D counts the handoff
    ``missing`` (it sent an empty checksum entry, pulled by D, on every handoff from an accelerator pool)."""
    setting, p, d = pair
    if setting == "off":
        return  # D's outcome is "off" whatever P sends; the "on" pair shows what D sees
    look = p.manager.effects.kv
    p.manager.effects.kv = Unsummed(look.kv, p.manager.effects.layout, p.manager.model)
    count = lambda outcome: d.manager.metrics.registry.get_sample_value(  # noqa: E731
        "fsm_pd_kv_checksums_total", {"role": "decode", "node": "decode-0", "outcome": outcome}) or 0
    missing = count("missing")
    try:
        answers, requests = serve(p, d, "unsummed")
    finally:
        p.manager.effects.kv = look
    assert all(a[-1].meta.get("kv_recompute") is None for a in answers)
    assert count("missing") == missing + len(PROMPTS)
    rooms = {r.bootstrap.room for r in requests}
    events = [row.event for row in read_journal(d.manager.journal.url) if row.room in rooms]
    assert not [e for e in events if "checksum_entry" in e or e.get("kv_checksum")]


def test_values_of_another_algorithm_are_not_compared(pair):
    """P checksums with the other algorithm (a CPU prefill node beside an accelerator decode node): READY names it,
    and D neither verifies nor fails the handoff: ``other_algorithm``, logged and counted, the request served from
    the KV it pulled."""
    setting, p, d = pair
    if setting == "off":
        return  # D's outcome is "off" whatever P sends
    jax_kv = p.manager.effects.kv.kv
    ours = jax_kv.checksum_algorithm
    count = lambda outcome: d.manager.metrics.registry.get_sample_value(  # noqa: E731
        "fsm_pd_kv_checksums_total", {"role": "decode", "node": "decode-0", "outcome": outcome}) or 0
    before = {outcome: count(outcome) for outcome in ("other_algorithm", "verified", "mismatch")}
    other = "crc32c" if ours == DEVICE_HASH else DEVICE_HASH
    jax_kv._algorithm = other
    try:
        answers, requests = serve(p, d, "other-algorithm")
    finally:
        jax_kv._algorithm = ours
    assert all(a[-1].meta.get("kv_recompute") is None for a in answers)
    assert count("other_algorithm") == before["other_algorithm"] + len(PROMPTS)
    assert (count("verified"), count("mismatch")) == (before["verified"], before["mismatch"])
    rooms = {r.bootstrap.room for r in requests}
    rows = [row for row in read_journal(d.manager.journal.url) if row.room in rooms]
    assert {row.event["kv_checksum_algorithm"] for row in rows if row.trigger == "kv_published"} == {other}
    assert {row.event["kv_checksum_check"] for row in rows if row.trigger == "scattered"} == {"other_algorithm"}
