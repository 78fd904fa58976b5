"""The pure decisions the coordinator's core asks (issue #19): where an upload's body goes,
how a verified update is placed, when a config change is in force, what state a round is
in. Each returns its reason; no clock, socket or file."""

from __future__ import annotations

import pytest

from fedtrain.coordinator.policy import (
    DIRECT_MAX_ACTIVE,
    change_effective,
    keeps_every_update,
    place_update,
    receive_path,
    round_state,
)
from tests.helpers.config import tiny_config

FIRST = {"fast_io": True, "action": "accept", "sum_empty": True, "active": 2, "plain": True, "fits": True}


def test_the_rounds_first_plain_update_goes_straight_into_the_sum() -> None:
    got = receive_path(**FIRST, cfg=tiny_config())
    assert got.path == "direct" and "first update" in got.reason


@pytest.mark.parametrize(("change", "cfg", "why"), [
    ({"fast_io": False}, {}, "FEDTRAIN_FAST_IO"),
    ({"action": "late"}, {}, "late"),
    ({"sum_empty": False}, {}, "already holds"),
    ({"active": DIRECT_MAX_ACTIVE + 1}, {}, f"more than {DIRECT_MAX_ACTIVE}"),
    ({}, {"outer": {"aggregator": "median"}}, "median aggregator"),
    ({}, {"outer": {"outlier_factor": 3.0}}, "outlier_factor"),
    ({}, {"outer": {"max_share": 0.3}}, "max_share 0.3"),
    ({}, {"outer": {"clip_norm": 1.0}}, "clip_norm"),
    ({}, {"late_uploads": "fold"}, "late_uploads=fold"),
    ({"plain": False}, {}, "compressed"),
    ({"fits": False}, {}, "not laid out"),
])
def test_every_other_update_is_spooled_and_says_why(change: dict, cfg: dict, why: str) -> None:
    got = receive_path(**{**FIRST, **change}, cfg=tiny_config(**cfg))
    assert got.path == "spool" and why in got.reason, got.reason


def test_a_verified_update_is_kept_folded_or_folded_after_the_one_in_the_sum() -> None:
    assert keeps_every_update(tiny_config())[0] is False
    plain = place_update(tiny_config(), direct_in_progress=False)
    assert (plain.action, plain.check_first) == ("fold", False)  # checked as it is folded
    beside = place_update(tiny_config(), direct_in_progress=True)
    assert (beside.action, beside.check_first) == ("fold_after", True) and "answered now" in beside.reason
    kept = place_update(tiny_config(outer={"aggregator": "trimmed_mean"}), direct_in_progress=False)
    assert (kept.action, kept.check_first) == ("keep", True)
    clipped = place_update(tiny_config(outer={"clip_norm": 2.0}), direct_in_progress=False)
    assert (clipped.action, clipped.check_first) == ("fold", True) and "norm" in clipped.reason


def test_a_config_change_is_in_force_at_once_only_if_no_one_started_the_round() -> None:
    assert change_effective(7, started=False) == (7, "no one has started round 7")
    later, why = change_effective(7, started=True)
    assert later == 8 and "training round 7" in why


@pytest.mark.parametrize(("round_", "closing", "finished", "state"), [
    (3, False, False, "closed"),
    (4, False, False, "committing"),
    (5, False, False, "open"),
    (5, True, False, "closing"),
    (5, False, True, "finished"),
    (6, False, False, "not_open"),
])
def test_the_state_of_a_round(round_: int, closing: bool, finished: bool, state: str) -> None:
    got, why = round_state(round_, current=5, committed=4, closing=closing, finished=finished)
    assert got == state and why
