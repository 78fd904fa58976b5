"""Balanced rounds: the pure rule that tells each participant its inner steps (`coordinator/balance.py`),
and the participant's own step clock and throttle (`participant/engine/pace.py`), with clocks passed in."""

from __future__ import annotations

import math

import pytest

from fedtrain.config import ScheduleConfig
from fedtrain.coordinator.policy.balance import (
    MAX_RATE,
    MIN_RATE,
    Reported,
    bounds,
    clean_rate,
    measured_rate,
    plan_steps,
    smoothed,
)
from fedtrain.participant.engine.pace import Pace, check_speed, told_steps

SCHEDULE = ScheduleConfig(mode="balanced")  # bounds 0.25-4 x H, smoothing 0.5


def plan(base: int, measured: dict[str, float | None], previous: dict[str, float | None] | None = None,
         cfg: ScheduleConfig = SCHEDULE) -> dict[str, int]:
    return {pid: a.sync_every for pid, a in plan_steps(base, measured, previous or {}, cfg).items()}


def test_all_finish_together_with_the_median_participant_at_h() -> None:
    # 1x, 0.5x, 0.25x: the median runs H, the fast one twice, the slow one half
    steps = plan(20, {"fast": 4.0, "mid": 2.0, "slow": 1.0})
    assert steps == {"fast": 40, "mid": 20, "slow": 10}
    # every participant's round takes the same time: H_i / s_i
    times = {pid: steps[pid] / rate for pid, rate in {"fast": 4.0, "mid": 2.0, "slow": 1.0}.items()}
    assert len(set(times.values())) == 1
    # the round's steps stay near lockstep's 3 x H
    assert sum(steps.values()) == 70


def test_the_reason_says_why() -> None:
    a = plan_steps(20, {"site-a": 4.0, "site-b": 2.0, "site-c": 1.0}, {}, SCHEDULE)
    assert a["site-c"].reason.startswith("site-c: 0.50x the median throughput (1 of 2 steps/s, smoothed) -> H=10 of 20")
    assert "bounded 0.25-4x H" in a["site-c"].reason
    assert a["site-a"].steps_per_s == 4.0


def test_bounds_hold_and_say_so() -> None:
    a = plan_steps(20, {"fast": 100.0, "mid": 1.0, "slow": 0.001}, {}, SCHEDULE)
    assert a["fast"].sync_every == 80 and "at the cap, max_steps_factor 4" in a["fast"].reason
    assert a["slow"].sync_every == 5 and "at the floor, min_steps_factor 0.25" in a["slow"].reason
    assert a["mid"].sync_every == 20
    # never below one step, whatever H and the factor
    assert bounds(1, SCHEDULE) == (1, 4) and bounds(3, ScheduleConfig(min_steps_factor=0.1)) == (1, 12)
    assert plan(1, {"a": 1.0, "b": 1e-3, "c": 1e-3})["a"] == 4
    assert plan(1, {"a": 1.0, "b": 1.0, "c": 1e-3})["c"] == 1


def test_no_throughput_yet_and_one_participant_run_h() -> None:
    assert plan(20, {"new": None}) == {"new": 20}
    assert plan(20, {"solo": 3.0}) == {"solo": 20}
    one = plan_steps(20, {"solo": 3.0, "new": None}, {}, SCHEDULE)
    assert one["solo"].sync_every == 20 and "the only participant with a measured throughput" in one["solo"].reason
    assert one["new"].sync_every == 20 and "no throughput measured yet" in one["new"].reason
    assert plan(20, {}) == {}
    # a participant without a rate does not count in the median; of two, the reference is the slower
    # (the lower median: one participant's claim cannot pull it above the other's rate)
    assert plan(20, {"fast": 4.0, "slow": 1.0, "new": None}) == {"fast": 80, "slow": 20, "new": 20}


@pytest.mark.parametrize("bad", [0.0, -5.0, math.nan, math.inf, -math.inf, None, "fast", True])
def test_a_bad_rate_counts_as_unknown_and_never_crashes(bad: object) -> None:
    assert clean_rate(bad) is None
    steps = plan(20, {"a": 4.0, "b": 1.0, "liar": bad})  # type: ignore[dict-item]
    assert steps["liar"] == 20 and steps["a"] == 80 and steps["b"] == 20


def test_an_absurd_rate_is_clamped_and_moves_the_median_by_one_rank_at_most() -> None:
    assert clean_rate(1e300) == MAX_RATE and clean_rate(1e-300) == MIN_RATE
    honest = {"a": 2.0, "b": 2.0, "c": 2.0}
    assert plan(20, honest) == {"a": 20, "b": 20, "c": 20}
    lying = plan(20, {**honest, "liar": 1e300})
    assert lying["liar"] == 80  # the cap
    assert {lying[p] for p in honest} == {20}  # the median of 2, 2, 2, huge is 2: the others are unmoved


def test_smoothing_keeps_one_slow_stretch_from_swinging_h() -> None:
    assert smoothed(1.0, 3.0, 0.5) == 2.0
    assert smoothed(None, 3.0, 0.5) == 3.0  # nothing new: the previous value stands
    assert smoothed(1.0, None, 0.5) == 1.0
    assert smoothed(1.0, 3.0, 0.0) == 1.0  # 0: only the latest counts
    # a participant that ran at 2 steps/s, then measured 0.5 for one round: with smoothing 0.5 it
    # counts as 1.25, not 0.5
    cfg = ScheduleConfig(mode="balanced", smoothing=0.5)
    steady = {"a": 2.0, "b": 2.0}
    a = plan_steps(20, {**steady, "c": 0.5}, {"a": 2.0, "b": 2.0, "c": 2.0}, cfg)
    assert a["c"].steps_per_s == pytest.approx(1.25) and a["c"].sync_every == 13  # 12.5, rounded up
    raw = plan_steps(20, {**steady, "c": 0.5}, {"a": 2.0, "b": 2.0, "c": 2.0}, ScheduleConfig(smoothing=0.0))
    assert raw["c"].sync_every == 5


def test_h_rounds_to_the_nearest_step() -> None:
    assert plan(10, {"a": 1.0, "b": 1.26, "c": 1.5}) == {"a": 8, "b": 10, "c": 12}


def test_steps_per_second_from_tokens_when_a_client_reports_only_those() -> None:
    assert measured_rate(Reported(steps_per_s=3.0, tokens_per_s=1e9), 256) == 3.0
    assert measured_rate(Reported(tokens_per_s=1024.0), 256) == 4.0
    assert measured_rate(Reported(tokens_per_s=1024.0, world_size=2), 256) == 2.0  # a group's tokens, all ranks
    assert measured_rate(Reported(tokens_per_s=1024.0, world_size=0), 256) == 4.0
    assert measured_rate(Reported(), 256) is None
    assert measured_rate(Reported(steps_per_s=-1.0, tokens_per_s=math.nan), 256) is None


def test_token_claims_are_bounded_by_the_steps_the_participant_was_told() -> None:
    from fedtrain.config import RunConfig
    from fedtrain.coordinator.policy import count_tokens, token_bound

    lockstep = RunConfig()
    balanced = RunConfig.model_validate({"schedule": {"mode": "balanced", "max_steps_factor": 4}})
    assert token_bound(balanced)[0] == token_bound(lockstep)[0]  # not told: train.sync_every
    assert token_bound(balanced, told=60)[0] == 3 * token_bound(lockstep)[0]  # its own H, 3 x sync_every 20
    assert "its told H 60" in token_bound(balanced, told=60)[1]
    claim = 3 * token_bound(lockstep)[0]  # the fast site of a balanced round honestly trained this much
    assert count_tokens(claim, balanced, told=60) == (claim, None)
    assert count_tokens(claim, balanced, told=5)[0] == token_bound(balanced, told=5)[0] < claim  # a slow site's
    assert count_tokens(claim, lockstep)[0] == token_bound(lockstep)[0]


def test_the_lower_median_keeps_an_honest_site_at_h_against_a_liar_of_two() -> None:
    # was: the mean of the two middle rates followed the liar to MAX_RATE and floored the honest site
    fast_liar = plan(20, {"honest": 2.0, "liar": 1e300})
    assert fast_liar == {"honest": 20, "liar": 80}
    slow_liar = plan(20, {"honest": 2.0, "liar": 1e-300})  # it can only raise the honest H, to the cap
    assert slow_liar == {"honest": 80, "liar": 20}
    # of four, one liar moves the reference by one place: the honest sites stay within their own spread
    assert plan(20, {"a": 1.0, "b": 2.0, "c": 4.0, "liar": 1e300}) == {"a": 10, "b": 20, "c": 40, "liar": 80}


# -- the participant's side ---------------------------------------------------------------------------


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_pace_times_the_loop_without_the_syncs() -> None:
    t = FakeTime()
    pace = Pace(clock=t.clock, sleep=t.sleep)
    assert pace.steps_per_s is None
    for _ in range(4):
        pace.resume()
        t.now += 0.1  # the user's step
        pace.stepped()
        t.now += 5.0  # a sync inside `step`: not counted
    assert pace.steps_per_s == pytest.approx(10.0) and t.slept == []


def test_pace_throttles_a_slow_site_by_its_own_step_time() -> None:
    t = FakeTime()
    pace = Pace(0.25, clock=t.clock, sleep=t.sleep)
    for step_s in (0.1, 0.2):
        pace.resume()
        t.now += step_s
        pace.stepped()
    assert t.slept == pytest.approx([0.3, 0.6])  # (1/0.25 - 1) x each step's own time
    assert pace.steps_per_s == pytest.approx(2 / 1.2)  # a quarter of the natural 2 / 0.3
    assert pace.slept_s == pytest.approx(0.9)


def test_pace_window_forgets_old_steps() -> None:
    t = FakeTime()
    pace = Pace(window=3, clock=t.clock, sleep=t.sleep)
    for step_s in (10.0, 0.5, 0.5, 0.5):
        pace.resume()
        t.now += step_s
        pace.stepped()
    assert pace.steps_per_s == pytest.approx(2.0)


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, math.nan, math.inf, "half", None, True])
def test_a_speed_that_cannot_work_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="speed must be a number above 0 and at most 1"):
        check_speed(bad)  # type: ignore[arg-type]


def test_told_steps_reads_only_what_can_work() -> None:
    assert told_steps({"assignment": {"sync_every": 7, "reason": "why"}}) == (7, "why")
    assert told_steps({"assignment": {"sync_every": 7}}) == (7, "")
    for bad in ({}, {"assignment": None}, {"assignment": {"sync_every": 0}}, {"assignment": {"sync_every": "7"}},
                {"assignment": {"sync_every": True}}, None, []):
        assert told_steps(bad) is None


# -- the slow site on purpose, from the command line ----------------------------------------------------


def test_demo_heterogeneous_runs_three_speeds_in_balanced_rounds_unless_told() -> None:
    from fedtrain.cli import build_parser
    from fedtrain.cli.demo import demo_config, speeds, steps_by_round

    parse = build_parser().parse_args
    args = parse(["demo", "--heterogeneous"])
    assert demo_config(args).schedule.mode == "balanced" and speeds(args, 3) == [1.0, 0.5, 0.25]
    assert speeds(args, 4) == [1.0, 0.5, 0.25, 1.0]
    assert demo_config(parse(["demo", "--heterogeneous", "--schedule", "rounds"])).schedule.mode == "rounds"
    plain = parse(["demo"])
    assert demo_config(plain).schedule.mode == "rounds" and speeds(plain, 4) == [1.0] * 4
    cfg = demo_config(plain)
    per_step = cfg.train.batch_size * cfg.train.seq_len
    metrics = [{"participant_id": "p0", "name": "tokens", "round": r, "value": h * per_step}
               for r, h in ((1, 41), (0, 20))] + [{"participant_id": "p1", "name": "tokens", "round": 0, "value": 1}]
    assert steps_by_round(metrics, "p0", cfg) == [20, 41]


@pytest.mark.parametrize("bad", ["2", "0", "-1", "nan", "half"])
def test_a_participant_speed_that_cannot_work_is_a_clear_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    from fedtrain.cli import build_parser

    argv = ["participant", "--coordinator", "http://x", "--data", "stdlib:0/1", "--speed", bad]
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2 and "--speed" in capsys.readouterr().err
    assert build_parser().parse_args([*argv[:-1], "0.25"]).speed == 0.25
