"""Asynchronous mode's pure rules (`merge/staleness.py`, `coordinator/async_policy.py`): the
staleness functions, which updates are taken and with what staleness, what each weighs, when
a version closes, N of the delayed Nesterov step, and which config asynchronous mode refuses."""

from __future__ import annotations

import itertools
import math

import pytest

from fedtrain.config import outer_choice
from fedtrain.coordinator import policy
from fedtrain.coordinator.policy import async_rules as async_policy
from fedtrain.errors import ConfigError
from fedtrain.merge.staleness import STALENESS_FUNCTIONS, staleness_factor
from tests.helpers.config import tiny_config


def async_cfg(**asynchronous: object) -> object:
    return tiny_config(schedule={"mode": "async"}, asynchronous=asynchronous)


# -- the staleness functions --------------------------------------------------------------------


def test_polynomial_is_one_over_one_plus_s_to_the_a() -> None:
    assert [staleness_factor(s, "polynomial", 0.5) for s in (0, 1, 3, 8)] == [1.0, 2**-0.5, 0.5, 1 / 3]
    assert staleness_factor(4, "polynomial", 1.0) == pytest.approx(0.2)
    assert staleness_factor(9, "polynomial", 0.0) == 1.0


def test_hinge_keeps_full_weight_up_to_b_then_falls_as_one_over_one_plus_a_times_the_excess() -> None:
    assert [staleness_factor(s, "hinge", 0.5, hinge=2) for s in (0, 1, 2)] == [1.0, 1.0, 1.0]
    assert staleness_factor(3, "hinge", 0.5, hinge=2) == pytest.approx(1 / 1.5)
    assert staleness_factor(6, "hinge", 0.5, hinge=2) == pytest.approx(1 / 3)


def test_constant_is_one() -> None:
    assert {staleness_factor(s, "constant", 3.0) for s in range(20)} == {1.0}


@pytest.mark.parametrize("fn", STALENESS_FUNCTIONS)
@pytest.mark.parametrize("a", [0.0, 0.5, 2.0])
def test_every_function_is_one_when_fresh_never_rises_and_stays_in_zero_one(fn: str, a: float) -> None:
    values = [staleness_factor(s, fn, a, hinge=3) for s in range(200)]
    assert values[0] == 1.0
    assert all(0 < v <= 1 and math.isfinite(v) for v in values)
    assert all(b <= a_ for a_, b in itertools.pairwise(values))


@pytest.mark.parametrize(("args", "match"), [((-1, "polynomial"), "staleness must be"),
                                             ((1.5, "polynomial"), "staleness must be"),
                                             ((True, "polynomial"), "staleness must be"),
                                             ((1, "linear"), "unknown staleness function"),
                                             ((1, "polynomial", float("nan")), "exponent"),
                                             ((1, "hinge", 0.5, -1), "hinge")])
def test_bad_arguments_are_refused(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        staleness_factor(*args)


# -- admission ----------------------------------------------------------------------------------


def test_a_fresh_update_is_taken_with_staleness_zero() -> None:
    a = async_policy.admit(5, 5, closing=False, finished=False, cfg=async_cfg())
    assert (a.action, a.staleness) == ("accept", 0) and "staleness 0" in a.reason


def test_a_stale_update_is_taken_with_the_versions_it_is_behind() -> None:
    a = async_policy.admit(2, 7, closing=False, finished=False, cfg=async_cfg(max_staleness=5))
    assert (a.action, a.staleness) == ("accept", 5)
    closing = async_policy.admit(2, 6, closing=True, finished=False, cfg=async_cfg(max_staleness=5))
    assert (closing.action, closing.staleness) == ("accept", 5)  # it goes into the next version


def test_an_update_beyond_max_staleness_is_refused_too_stale_with_the_reason() -> None:
    a = async_policy.admit(1, 7, closing=False, finished=False, cfg=async_cfg(max_staleness=5))
    assert (a.action, a.code, a.staleness) == ("refuse", "too_stale", 6)
    assert "trained from version 1, 6 versions behind the global model (version 7)" in a.reason
    assert "max_staleness 5" in a.reason
    assert async_policy.admit(3, 3, closing=True, finished=False, cfg=async_cfg(max_staleness=0)).code == "too_stale"


def test_a_version_not_made_yet_and_a_finished_run_are_refused() -> None:
    assert async_policy.admit(8, 7, closing=False, finished=False, cfg=async_cfg()).code == "round_closed"
    assert async_policy.admit(7, 7, closing=False, finished=True, cfg=async_cfg()).code == "run_finished"


def test_the_open_round_admits_by_the_mode_in_force() -> None:
    from fedtrain.coordinator.rounds.open_round import OpenRound

    open_ = OpenRound(6, 0.0, [])
    assert open_.admission(3, False, async_cfg()).action == "accept"
    assert open_.admission(3, False, tiny_config()).action == "refuse"  # rounds: late_uploads refuse


# -- weight, closing, N -------------------------------------------------------------------------


def test_weight_says_how_it_is_made() -> None:
    assert async_policy.weight(3, async_cfg()) == (0.5, "weight x0.5 ((1 + 3)^-0.5)")
    factor, why = async_policy.weight(5, async_cfg(staleness_fn="hinge", staleness_exponent=1.0,
                                                  staleness_hinge=1))
    assert factor == pytest.approx(0.2) and why == "weight x0.2 (hinge: 1 / (1 + 1 x (5 - 1)))"
    assert async_policy.weight(9, async_cfg(staleness_fn="constant"))[0] == 1.0


def test_the_step_scale_is_the_staleness_weight_of_the_update() -> None:
    cfg = async_cfg()
    assert async_policy.scale({"p0": 512}, {"p0": 3}, cfg) == 0.5
    assert async_policy.scale({"p0": 300, "p1": 100}, {"p0": 0, "p1": 3}, cfg) == pytest.approx((300 + 50) / 400)
    uniform = tiny_config(schedule={"mode": "async"}, outer={"weighting": "uniform"})
    assert async_policy.scale({"p0": 300, "p1": 100}, {"p0": 0, "p1": 3}, uniform) == pytest.approx(0.75)
    assert async_policy.scale({}, {}, cfg) == 1.0


def test_a_version_closes_as_soon_as_it_holds_an_update() -> None:
    cfg = async_cfg()
    wait = async_policy.decide(4, {}, cfg)
    assert wait.action == "wait" and "waits for the next update" in wait.reason
    close = async_policy.decide(4, {"p1": 3}, cfg)
    assert close.action == "close"
    assert close.reason == ("asynchronous: p1's update (trained from version 1, staleness 3, weight x0.5 "
                            "((1 + 3)^-0.5)) applied at once")


def test_n_is_the_active_participants_or_the_configured_number() -> None:
    assert async_policy.momentum_period(3, async_cfg()) == (3, "3 active participant(s)")
    assert async_policy.momentum_period(0, async_cfg())[0] == 1
    assert async_policy.momentum_period(3, async_cfg(momentum_every=8)) == (8, "asynchronous.momentum_every 8")


def test_an_upload_is_a_duplicate_when_its_participant_has_an_update_in_its_round_or_later() -> None:
    assert async_policy.submitted_before(None, 4) is False
    assert async_policy.submitted_before(3, 4) is False  # an update of an earlier base
    assert async_policy.submitted_before(4, 4) and async_policy.submitted_before(9, 4)


# -- the config ---------------------------------------------------------------------------------


def test_async_mode_takes_the_delayed_nesterov_step_unless_told_per_update() -> None:
    assert outer_choice(async_cfg())[0] == "delayed_nesterov"
    assert outer_choice(async_cfg(outer_step="per_update"))[0] == "diloco"
    assert outer_choice(tiny_config())[0] == "diloco"
    assert outer_choice(async_cfg())[1] == outer_choice(tiny_config())[1]  # DiLoCo's lr and momentum


@pytest.mark.parametrize(("overrides", "match"), [
    ({"outer": {"aggregator": "median"}}, "outer.aggregator median needs a round's updates together"),
    ({"outer": {"outlier_factor": 3.0}}, "outlier_factor compares a round's updates"),
    ({"outer": {"algorithm": "fedadam"}}, "delayed_nesterov needs Nesterov momentum"),
    ({"outer": {"algorithm": "fedavgm"}}, "delayed_nesterov needs Nesterov momentum"),
])
def test_what_async_mode_cannot_do_is_refused_with_the_reason(overrides: dict, match: str) -> None:
    from fedtrain.config import parse_config

    data = {"schedule": {"mode": "async"}, **overrides}
    with pytest.raises(ConfigError, match=match):
        parse_config(data)
    parse_config({**data, "schedule": {"mode": "rounds"}})  # fine in rounds mode
    if "algorithm" in overrides["outer"]:
        parse_config({**data, "asynchronous": {"outer_step": "per_update"}})


def test_an_async_update_is_always_spooled() -> None:
    path = policy.receive_path(fast_io=True, action="accept", sum_empty=True, active=1, plain=True, fits=True,
                               cfg=async_cfg())
    assert path.path == "spool" and "asynchronous mode" in path.reason
