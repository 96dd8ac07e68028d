"""The router's fleet without processes: the circuit breaker, least-outstanding selection and the retry budget, on a
fake clock."""

from __future__ import annotations

import pytest

from fsm_pd.router.fleet import BreakerSettings, Fleet, Worker
from fsm_pd.router.retries import RetryBudget


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet(n_prefill=2, n_decode=2, policy="least_outstanding", **breaker):
    clock, events = Clock(), []
    f = Fleet([Worker("prefill", f"http://p{i}") for i in range(n_prefill)],
              [Worker("decode", f"http://d{i}") for i in range(n_decode)], policy=policy,
              breaker=BreakerSettings(**breaker), clock=clock, observer=lambda *e: events.append(e))
    return f, clock, events


def test_least_outstanding_picks_the_idlest_and_takes_turns_on_ties():
    f, _, _ = fleet(n_prefill=3)
    p0, p1, p2 = f.workers["prefill"]
    assert [f.pick("prefill") for _ in range(3)] == [p0, p1, p2]  # all idle: in turn
    p0.outstanding, p1.outstanding, p2.outstanding = 4, 1, 3
    assert f.pick("prefill") is p1
    p1.outstanding = 5
    assert f.pick("prefill") is p2


def test_avoided_workers_are_used_only_when_nothing_else_is_admitted():
    f, _, _ = fleet()
    p0, p1 = f.workers["prefill"]
    p1.outstanding = 10
    assert f.pick("prefill", avoid=[p0]) is p1
    p1.admitted = False
    assert f.pick("prefill", avoid=[p0]) is p0


def test_consecutive_request_failures_eject_and_a_success_resets_the_count():
    f, _, events = fleet(request_failures=3)
    p0, p1 = f.workers["prefill"]
    f.request_failed(p0, "boom")
    f.request_failed(p0, "boom")
    f.request_succeeded(p0)
    f.request_failed(p0, "boom")
    f.request_failed(p0, "boom")
    assert p0.admitted
    f.request_failed(p0, "refused")
    assert not p0.admitted and "refused" in p0.reason
    assert events == [("ejected", "prefill", "requests")]
    assert all(f.pick("prefill") is p1 for _ in range(4))


def test_health_failures_eject_and_readmission_waits_for_the_cooldown():
    f, clock, events = fleet(health_failures=2, cooldown_s=10.0)
    d0, d1 = f.workers["decode"]
    f.health_checked(d0, False, "ConnectError")
    assert d0.admitted
    f.health_checked(d0, False, "ConnectError")
    assert not d0.admitted
    clock.now += 5
    f.health_checked(d0, True)  # healthy again, but the cool-down has not passed
    assert not d0.admitted
    clock.now += 5
    f.health_checked(d0, True)
    assert d0.admitted and d0.reason == ""
    assert events == [("ejected", "decode", "health_check"), ("readmitted", "decode", "health_ok")]


def test_a_failing_ejected_worker_restarts_its_cooldown():
    f, clock, _ = fleet(health_failures=1, cooldown_s=10.0)
    d0 = f.workers["decode"][0]
    f.health_checked(d0, False, "down")
    clock.now += 8
    f.health_checked(d0, False, "still down")
    clock.now += 8  # 16 s after the first ejection, 8 after the last failure
    f.health_checked(d0, True)
    assert not d0.admitted
    clock.now += 2
    f.health_checked(d0, True)
    assert d0.admitted


def test_draining_ejects_at_once():
    f, _, events = fleet(health_failures=3)
    p0 = f.workers["prefill"][0]
    f.health_checked(p0, False, "/health answered 503", draining=True)
    assert not p0.admitted and p0.reason.startswith("draining")
    assert events == [("ejected", "prefill", "draining")]


def test_a_starting_node_is_ejected_at_once_and_readmitted_by_its_first_200():
    """A restarted node answers 503 starting: it gets nothing until it is ready, and then no cool-down holds it back
    (it is a new process, not a flapping one), even after connection failures ejected the old one."""
    f, clock, events = fleet(health_failures=2, cooldown_s=10.0)
    d0 = f.workers["decode"][0]
    f.health_checked(d0, False, "ConnectError")
    f.health_checked(d0, False, "ConnectError")  # the old process is gone: ejected
    clock.now += 3
    f.health_checked(d0, False, "/health answered 503", starting=True)
    assert not d0.admitted and d0.reason.startswith("starting")
    assert f.pick("decode") is f.workers["decode"][1]
    clock.now += 1
    f.health_checked(d0, True)
    assert d0.admitted
    f.health_checked(d0, False, "/health answered 503", starting=True)  # an admitted node restarted between checks
    assert not d0.admitted
    assert [e[2] for e in events] == ["health_check", "health_ok", "starting"]


def test_failed_requests_never_eject_the_last_admitted_worker_but_health_checks_do():
    f, _, _ = fleet(request_failures=1, health_failures=1)
    p0, p1 = f.workers["prefill"]
    f.request_failed(p0, "ConnectError")
    f.request_failed(p1, "bootstrap timeout")  # the survivor, overloaded for a while
    assert not p0.admitted and p1.admitted
    f.health_checked(p1, False, "ConnectError")
    assert f.pick("prefill") is None
    assert f.unavailable("prefill").count("ConnectError") == 2
    assert f.pick("decode") is not None


def test_round_robin_skips_ejected_workers():
    f, _, _ = fleet(n_prefill=3, policy="round_robin")
    p0, p1, p2 = f.workers["prefill"]
    p1.admitted = False
    assert [f.pick("prefill") for _ in range(4)] == [p0, p2, p0, p2]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        fleet(policy="fastest")
    with pytest.raises(ValueError):
        fleet(request_failures=0)
    with pytest.raises(ValueError):
        Fleet([], [Worker("decode", "http://d")])


def test_retry_budget_has_a_floor_per_second_and_a_ratio_of_requests():
    clock = Clock()
    budget = RetryBudget(ratio=0.2, min_per_s=0.5, window_s=10.0, clock=clock)  # floor: 5 retries per window
    assert [budget.try_retry() for _ in range(6)] == [True] * 5 + [False]
    for _ in range(50):
        budget.request()
    assert budget.allowed() == 10  # 0.2 x 50 requests
    assert [budget.try_retry() for _ in range(6)] == [True] * 5 + [False]  # 5 more: 10 in the window
    assert "10 retries" in budget.describe()


def test_retry_budget_window_slides():
    clock = Clock()
    budget = RetryBudget(ratio=0.0, min_per_s=0.2, window_s=10.0, clock=clock)  # 2 per window
    assert budget.try_retry() and budget.try_retry() and not budget.try_retry()
    clock.now += 10.5
    assert budget.try_retry()


def test_a_refused_connection_takes_even_the_last_worker_out_at_once_and_its_first_200_takes_it_back():
    """Nothing listens at the address: no request can reach it, so neither the thresholds nor the last-of-its-role
    rule hold it in (it got every long prompt, each answered 503, until three health checks failed), and the node
    that comes back there is a new process: no cool-down."""
    f, clock, events = fleet(n_prefill=1, health_failures=3, request_failures=3, cooldown_s=10.0)
    (p0,) = f.workers["prefill"]
    f.refused(p0, "ConnectError: All connection attempts failed")
    assert not p0.admitted and p0.reason.startswith("refused") and f.pick("prefill") is None
    clock.now += 1
    f.health_checked(p0, True)
    assert p0.admitted
    f.health_checked(p0, False, "ConnectError", refused=True)  # a health check finds it gone
    assert not p0.admitted
    assert not p0.lost.is_set()  # its connections broke with it: no stream waits on a stopped node
    assert [e[2] for e in events] == ["refused", "health_ok", "refused"]


def test_retries_back_off_doubling_up_to_a_bound():
    from fsm_pd.router.retries import RETRY_BACKOFF_MAX_S, retry_backoff

    assert [retry_backoff(n) for n in range(4)] == [0.0, 0.05, 0.1, 0.2]
    assert retry_backoff(30) == RETRY_BACKOFF_MAX_S == 1.0
