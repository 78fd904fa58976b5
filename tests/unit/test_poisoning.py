"""What one participant can do to the merge with finite values: the pure pieces.

The running sum cannot overflow for finite inputs, an outer step that overflows says so
instead of handing out Inf, token claims count up to the round's schedule, and no update
takes more than `max_share` of a round (checked against hand-computed values).
"""

from __future__ import annotations

import math

import pytest
import torch

from fedtrain.config import outer_defaults, parse_config
from fedtrain.coordinator import policy
from fedtrain.coordinator.policy import Contribution
from fedtrain.merge import OuterOptimizer, RunningSum, weighted_mean
from fedtrain.merge.aggregate import MAX_UPDATE_ABS, max_abs
from fedtrain.merge.outer import NonFiniteStep
from tests.helpers.config import tiny_config

BIG = 3e38  # finite float32, passes every NaN/Inf check


# --------------------------------------------------------------------------- the running sum


def test_two_huge_finite_updates_average_to_a_finite_mean() -> None:
    """FedAvg's two-huge-uploads attack: 3e38 + 3e38 is Inf in float32, their mean is not."""
    acc = RunningSum({"w": torch.zeros(4)})
    for _ in range(2):
        acc.add({"w": torch.full((4,), BIG)}, 1.0)
    tensors, divisor = acc.scaled()
    mean = tensors["w"] / divisor
    assert torch.isfinite(mean).all()
    torch.testing.assert_close(mean, torch.full((4,), BIG))
    assert acc.rescales == 1 and acc.bound <= 2.0**127


def test_a_heavy_update_after_a_light_one_does_not_overflow_the_sum() -> None:
    """The sum holds Σ wᵢΔᵢ / w₁: a later weight 2**40 times the first multiplies its values by
    2**40. The sum scales itself down by a power of two instead, exactly."""
    g = torch.Generator().manual_seed(0)
    light = {"w": torch.randn(6, generator=g) * 1e-3, "b": torch.randn(3, generator=g)}
    heavy = {"w": torch.full((6,), 1e30), "b": torch.full((3,), -1e30)}
    acc = RunningSum(light)
    acc.add(light, 1.0)
    acc.add(heavy, 2.0**40)
    mean = acc.mean()
    want = weighted_mean([{k: v.double() for k, v in light.items()}, {k: v.double() for k, v in heavy.items()}],
                         [1.0, 2.0**40])
    for k in want:
        assert torch.isfinite(mean[k]).all(), k
        torch.testing.assert_close(mean[k].double(), want[k], rtol=1e-6, atol=0)
    assert acc.rescales == 1


def test_ordinary_updates_never_rescale_and_fold_as_before() -> None:
    g = torch.Generator().manual_seed(1)
    deltas = [{"w": torch.randn(50, generator=g)} for _ in range(5)]
    acc = RunningSum(deltas[0])
    for i, d in enumerate(deltas):
        acc.add(d, float(10 * (i + 1)), max_abs=max_abs(d["w"]))
    assert acc.rescales == 0
    torch.testing.assert_close(acc.mean()["w"], weighted_mean(deltas, [10, 20, 30, 40, 50])["w"])


def test_max_abs_sees_nan_and_inf() -> None:
    assert max_abs(torch.tensor([1.0, -3.0, 2.0])) == 3.0
    assert math.isnan(max_abs(torch.tensor([1.0, float("nan")])))
    assert max_abs(torch.tensor([float("-inf")])) == math.inf
    assert max_abs(torch.zeros(0)) == 0.0 and max_abs(torch.arange(3)) == 0.0


# --------------------------------------------------------------------------- the outer step


def outer(algorithm: str, **hp: float) -> OuterOptimizer:
    cfg = parse_config({"outer": {"algorithm": algorithm, **hp}})
    return OuterOptimizer({"x": torch.ones(3)}, algorithm, outer_defaults(cfg))


def test_nesterov_overflow_of_a_finite_delta_raises_instead_of_handing_out_inf() -> None:
    """DiLoCo: Δ = 3e38 is finite; Nesterov's grad + 0.9·momentum is 5.7e38: Inf weights."""
    opt = outer("diloco")
    with pytest.raises(NonFiniteStep, match="made x NaN or infinite") as e:
        opt.step({"x": torch.full((3,), BIG)})
    assert e.value.details == {"tensor": "x"}


def test_adam_second_moment_overflow_is_caught_though_the_weights_look_finite() -> None:
    """FedAdam: g = 1e25 makes (1 - beta2)·g² Inf; the step m / (sqrt(Inf) + eps) is 0, the
    weights stay finite, and the run would be frozen from then on. The moment is checked too."""
    opt = outer("fedadam")
    with pytest.raises(NonFiniteStep, match="exp_avg_sq of x"):
        opt.step({"x": torch.full((3,), 1e25)})
    assert torch.isfinite(opt.params["x"]).all()  # what a check of the weights alone would have let through


def test_a_delta_within_the_value_bound_steps_every_algorithm_finitely() -> None:
    """MAX_UPDATE_ABS is small enough that no default outer optimizer overflows on it."""
    for algorithm in ("fedavg", "diloco", "fedavgm", "fedadam", "fedyogi"):
        opt = outer(algorithm)
        for _ in range(3):
            opt.step({"x": torch.full((3,), MAX_UPDATE_ABS)})
        assert torch.isfinite(opt.params["x"]).all(), algorithm


def test_a_divisor_below_one_divides_in_place_without_a_copy() -> None:
    """A sum that scaled itself down hands out a divisor below 1: the step divides Δ in place."""
    opt = outer("fedavg")
    delta = {"x": torch.full((3,), 2.0)}
    ptr = delta["x"].data_ptr()
    opt.step(delta, 0.5)
    assert delta["x"].data_ptr() == ptr and torch.equal(delta["x"], torch.full((3,), 4.0))
    assert torch.equal(opt.params["x"], torch.full((3,), -3.0))


# --------------------------------------------------------------------------- token claims


def test_token_bound_is_the_rounds_schedule_times_the_slack() -> None:
    cfg = tiny_config()  # sync_every 5, batch_size 8, seq_len 32; token_slack 16 by default
    bound, why = policy.token_bound(cfg)
    assert bound == 5 * 8 * 32 * 16 == 20_480
    assert why == "train.sync_every 5 x batch_size 8 x seq_len 32 x outer.token_slack 16 = 20,480"
    assert policy.count_tokens(1280, cfg) == (1280, None)
    assert policy.count_tokens(20_480, cfg) == (20_480, None)
    counted, reason = policy.count_tokens(2**62, cfg)
    assert counted == 20_480
    assert reason == (f"claimed {2**62:,} tokens, more than a round's schedule allows "
                      "(train.sync_every 5 x batch_size 8 x seq_len 32 x outer.token_slack 16 = 20,480); "
                      "counted as 20,480")
    slack = tiny_config(train={"sync_every": 3}, outer={"token_slack": 1.5})
    assert policy.token_bound(slack)[0] == 3 * 8 * 32 * 3 // 2 == 1152


# --------------------------------------------------------------------------- capping shares


def test_cap_shares_hand_computed() -> None:
    # a has 6/10: capped at 1/2; the other 1/2 goes to b and c as 3:1
    shares, reasons = policy.cap_shares({"a": 6, "b": 3, "c": 1}, 0.5)
    assert shares == pytest.approx({"a": 0.5, "b": 0.375, "c": 0.125})
    assert list(reasons) == ["a"] and reasons["a"].startswith("share 0.6 capped at 0.5 (max_share 0.5)")
    # water-filling: a (0.5) is capped at 0.4, which lifts b from 0.39 to 0.39 * 0.6 / 0.5 = 0.468 > 0.4,
    # so b is capped too, and c has what is left: 0.2
    shares, reasons = policy.cap_shares({"a": 5.0, "b": 3.9, "c": 1.1}, 0.4)
    assert shares == pytest.approx({"a": 0.4, "b": 0.4, "c": 0.2})
    assert list(reasons) == ["a"]  # b's share rose: not cut
    # the cap cannot be met by 3 updates: each has 1/3
    shares, reasons = policy.cap_shares({"a": 5, "b": 1, "c": 1}, 0.2)
    assert shares == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    assert "3 updates cannot all stay under it" in reasons["a"]


def test_cap_shares_leaves_one_update_and_a_cap_of_one_alone_and_caps_a_pair_at_the_pair_cap() -> None:
    assert policy.cap_shares({"a": 9}, 0.5) == ({"a": 1.0}, {})  # 1 < MIN_FOR_CAP
    # a round of two: (1 + 0.5) / 2 = 0.75, so that neither takes the merge by claiming tokens
    shares, reasons = policy.cap_shares({"a": 9, "b": 1}, 0.5)
    assert shares == pytest.approx({"a": 0.75, "b": 0.25}) and policy.pair_cap(0.5) == 0.75
    assert list(reasons) == ["a"] and "a round of two: (1 + max_share 0.5) / 2" in reasons["a"]
    assert policy.cap_shares({"a": 2, "b": 1}, 0.5) == ({"a": 2 / 3, "b": 1 / 3}, {})  # under it
    assert policy.cap_shares({"a": 9, "b": 1}, 1.0) == ({"a": 0.9, "b": 0.1}, {})  # 1 turns it off
    assert policy.cap_shares({"a": 8, "b": 1, "c": 1}, 1.0) == ({"a": 0.8, "b": 0.1, "c": 0.1}, {})
    assert policy.cap_shares({"a": 1, "b": 1, "c": 2}, 0.5) == ({"a": 0.25, "b": 0.25, "c": 0.5}, {})  # at it


def test_over_share_names_who_could_still_be_capped() -> None:
    assert policy.over_share({"a": 6, "b": 3, "c": 1}, 0.5) == {"a"}
    assert policy.over_share({"a": 5, "b": 5}, 0.5) == set()  # exactly at the cap
    assert policy.over_share({"a": 1}, 1.0) == set()


def c(weight: float, folded: bool, largest: float = 1.0) -> Contribution:
    return Contribution(weight, largest, folded)


def test_to_fold_keeps_the_sum_reweighable() -> None:
    # the first update is the sum alone, whatever its share
    assert policy.to_fold({"a": c(6, False)}, 0.5, 3) == ["a"]
    # the sum's one update could still be capped (6 of 7): the next one waits
    assert policy.to_fold({"a": c(6, True), "b": c(1, False)}, 0.5, 3) == []
    # diluted (6 of 12): it is safe for good, and everything waiting goes in
    assert policy.to_fold({"a": c(6, True), "b": c(1, False), "c": c(5, False)}, 0.5, 3) == ["b", "c"]
    # a safe sum takes the safe ones; the one that could be capped waits
    assert policy.to_fold({"a": c(1, True), "b": c(1, True), "c": c(9, False)}, 0.5, 4) == []
    assert policy.to_fold({"a": c(1, True), "b": c(1, True), "d": c(1, False), "c": c(9, False)}, 0.5, 4) == ["d"]
    # a round that can reach two only: the pair cap (0.75) applies, so 6 of 7 waits for it
    assert policy.to_fold({"a": c(6, True), "b": c(1, False)}, 0.5, 2) == []
    assert policy.to_fold({"a": c(2, True), "b": c(1, False)}, 0.5, 2) == ["b"]  # 2 of 3: under it
    # no cap can apply: one update, or max_share 1
    assert policy.to_fold({"a": c(6, False)}, 0.5, 1) == ["a"]
    assert policy.to_fold({"a": c(6, True), "b": c(1, False)}, 1.0, 9) == ["b"]


def test_closing_weights_fold_the_waiting_in_the_sums_units() -> None:
    # a (6) is the sum alone, b (3) and c (1) wait: shares 1/2, 3/8, 1/8. The sum holds a with
    # weight 6 = 1/2 of the total, so the total is 12: b is folded with 12 * 3/8 = 4.5, c with 1.5.
    shares, fold, reasons = policy.closing_weights({"a": c(6, True), "b": c(3, False), "c": c(1, False)}, 0.5)
    assert shares == pytest.approx({"a": 0.5, "b": 0.375, "c": 0.125})
    assert fold == pytest.approx({"b": 4.5, "c": 1.5}) and list(reasons) == ["a"]
    # the capped one waits, the sum holds the others: their weights stay, a is folded with 1/2 of 2/(1/2)
    shares, fold, _ = policy.closing_weights({"b": c(1, True), "c": c(1, True), "a": c(8, False)}, 0.5)
    assert shares == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.25}) and fold == pytest.approx({"a": 2.0})
    # capped but summed with others already (the cap came to apply late): merged uncapped, and said so
    shares, fold, reasons = policy.closing_weights({"a": c(8, True), "b": c(1, True), "c": c(1, False)}, 0.5)
    assert shares == pytest.approx({"a": 0.8, "b": 0.1, "c": 0.1}) and fold == pytest.approx({"c": 1.0})
    assert "not capped this round" in reasons["a"]


def test_largest_influence_is_share_times_largest_value() -> None:
    key, why = policy.largest_influence({"a": 0.5, "b": 0.3, "c": 0.2}, {"a": 1.0, "b": 1e9, "c": 2.0})
    assert key == "b" and why == "of the 3 updates it moves the merge the most: share 0.3 x largest value 1e+09"
    assert policy.largest_influence({"a": 0.5, "b": 0.5}, {"a": 1.0})[0] == "b"  # not known: counts as Inf
