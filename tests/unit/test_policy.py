"""Round closing and heartbeat rules, with the clock passed in."""

from __future__ import annotations

from fedtrain.coordinator.policy import (
    ACTIVE,
    FAILED,
    LEFT,
    ParticipantView,
    RoundView,
    decide_round,
    run_finished,
    stale_participants,
)
from tests.helpers.config import tiny_config

CFG = tiny_config(round_timeout_s=100.0, min_participants=2, heartbeat_timeout_s=30.0)


def people(*states: str, seen: float = 0.0) -> list[ParticipantView]:
    return [ParticipantView(f"p{i}", s, seen) for i, s in enumerate(states)]


def rnd(*submitted: str, opened: float = 0.0) -> RoundView:
    return RoundView(4, opened, frozenset(submitted))


def test_waits_with_no_submissions_even_after_deadline() -> None:
    d = decide_round(rnd(), people(ACTIVE, ACTIVE), 1000.0, CFG)
    assert d.action == "wait" and "no submissions" in d.reason


def test_closes_when_every_active_participant_submitted() -> None:
    d = decide_round(rnd("p0", "p1"), people(ACTIVE, ACTIVE, FAILED, LEFT), 5.0, CFG)
    assert d.action == "close" and "all 2 active" in d.reason


def test_waits_for_missing_before_deadline_and_names_them() -> None:
    d = decide_round(rnd("p0", "p1"), people(ACTIVE, ACTIVE, ACTIVE), 50.0, CFG)
    assert d.action == "wait" and "p2" in d.reason and "deadline in 50s" in d.reason


def test_deadline_closes_with_quorum() -> None:
    d = decide_round(rnd("p0", "p1"), people(ACTIVE, ACTIVE, ACTIVE), 100.0, CFG)
    assert d.action == "close" and "deadline" in d.reason and "p2" in d.reason


def test_deadline_without_quorum_keeps_waiting() -> None:
    d = decide_round(rnd("p0"), people(ACTIVE, ACTIVE), 150.0, CFG)
    assert d.action == "wait" and "min_participants 2" in d.reason


def test_all_submitted_below_quorum_waits() -> None:
    d = decide_round(rnd("p0"), people(ACTIVE, FAILED), 10.0, CFG)
    assert d.action == "wait" and "min_participants" in d.reason


def test_stale_participants_only_active_and_silent() -> None:
    ps = [
        ParticipantView("a", ACTIVE, 0.0),
        ParticipantView("b", ACTIVE, 80.0),
        ParticipantView("c", FAILED, 0.0),
        ParticipantView("d", LEFT, 0.0),
    ]
    stale = stale_participants(ps, 100.0, CFG)
    assert [pid for pid, _ in stale] == ["a"]
    assert "no heartbeat for 100s" in stale[0][1]


def test_run_finished() -> None:
    assert not run_finished(2, tiny_config(rounds=3))
    assert run_finished(3, tiny_config(rounds=3))
    assert not run_finished(10**6, tiny_config(rounds=0))
