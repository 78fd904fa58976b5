"""Straggler and outage rules with the clock passed in: adaptive deadlines, late uploads, participant backoff."""

from __future__ import annotations

import pytest

from fedtrain.coordinator.policy import (
    ACTIVE,
    ParticipantView,
    RoundView,
    adaptive_deadline,
    admit_upload,
    decide_round,
)
from fedtrain.errors import AuthError, CoordinatorError, CoordinatorUnavailable
from fedtrain.participant.engine.outage import OutagePolicy, OutageState, is_transient, next_attempt
from tests.helpers.config import tiny_config

ADAPTIVE = tiny_config(
    deadline="adaptive", deadline_factor=3.0, deadline_min_s=5.0, round_timeout_s=100.0, deadline_window=2
)


def test_fixed_deadline_is_round_timeout() -> None:
    s, why = adaptive_deadline([[1.0, 2.0]], tiny_config(round_timeout_s=42.0))
    assert s == 42.0 and "fixed" in why


def test_adaptive_deadline_from_median_submit_time() -> None:
    s, why = adaptive_deadline([[1.0, 2.0, 3.0], [4.0, 6.0, 50.0]], ADAPTIVE)
    assert s == pytest.approx(3 * 3.5)  # median of six times; the 50 s straggler does not move it
    assert "median submit time 3.5s" in why


def test_adaptive_deadline_window_floor_and_cap() -> None:
    old_slow = [[90.0, 90.0]]
    assert adaptive_deadline([*old_slow, [1.0], [1.0]], ADAPTIVE)[0] == 5.0  # only the last 2 rounds count
    s, why = adaptive_deadline([[1.0]], ADAPTIVE)
    assert s == 5.0 and "deadline_min_s" in why
    s, why = adaptive_deadline([[60.0]], ADAPTIVE)
    assert s == 100.0 and "capped" in why
    s, why = adaptive_deadline([], ADAPTIVE)
    assert s == 100.0 and "no submit times" in why


def test_decide_round_uses_the_round_deadline() -> None:
    people = [ParticipantView("a", ACTIVE, 0.0), ParticipantView("b", ACTIVE, 0.0)]
    rnd = RoundView(3, 0.0, frozenset({"a"}), deadline_s=10.0)
    assert decide_round(rnd, people, 9.0, ADAPTIVE).action == "wait"
    d = decide_round(rnd, people, 10.0, ADAPTIVE)
    assert d.action == "close" and "deadline of 10s" in d.reason and "b" in d.reason


def test_admission() -> None:
    refuse, fold = tiny_config(), tiny_config(late_uploads="fold", max_staleness=2, staleness_discount=0.5)
    assert admit_upload(4, 4, False, False, refuse).action == "accept"
    a = admit_upload(3, 4, False, False, refuse)
    assert a.action == "refuse" and a.code == "round_closed" and "closed" in a.reason
    assert admit_upload(5, 4, False, False, fold).action == "refuse"  # from the future
    assert admit_upload(4, 4, True, False, fold).code == "round_closed"  # closing
    assert admit_upload(4, 4, False, True, fold).code == "run_finished"
    late = admit_upload(2, 4, False, False, fold)
    assert late.action == "late" and late.staleness == 2 and "x 0.25" in late.reason
    too_old = admit_upload(1, 4, False, False, fold)
    assert too_old.action == "refuse" and "max_staleness 2" in too_old.reason


def test_outage_backoff_then_give_up() -> None:
    policy = OutagePolicy(attempt_s=1.0, backoff_initial_s=1.0, backoff_max_s=4.0)
    state = OutageState(last_error="connection refused")
    first = next_attempt(state, 100.0, policy, budget_s=30.0)
    assert first.action == "retry_later" and first.delay_s == 1.0 and "training on locally" in first.reason
    state.since, state.attempts = 100.0, 3
    assert next_attempt(state, 110.0, policy, 30.0).delay_s == 4.0  # 8 s capped at backoff_max_s
    assert next_attempt(state, 128.5, policy, 30.0).delay_s == pytest.approx(1.5)  # never past the budget
    gone = next_attempt(state, 130.0, policy, 30.0)
    assert gone.action == "give_up" and "unreachable for 30s" in gone.reason and "connection refused" in gone.reason


def test_one_attempt_never_retries_longer_than_the_whole_outage_budget() -> None:
    policy = OutagePolicy(attempt_s=10.0)
    assert policy.attempt_window(300.0) == 10.0
    assert policy.attempt_window(2.0) == 2.0  # --give-up-after 2: not a 10 s upload retry first


def test_transient_errors() -> None:
    assert is_transient(CoordinatorUnavailable("down"))
    assert is_transient(CoordinatorError("boom", status=500))
    assert not is_transient(CoordinatorError("bad", status=422))
    assert not is_transient(AuthError("no", status=401))
