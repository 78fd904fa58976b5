"""Unit tests of fedtrain.merge: compatibility checks, weighting, running sums, hand-computed rounds.

Expected values of the outer steps are worked out by hand in the comments (and written as
literals), never computed with the code under test.
"""

from __future__ import annotations

import pytest
import torch

from fedtrain.errors import MergeError
from fedtrain.merge import (
    ALGORITHMS,
    OuterOptimizer,
    RunningSum,
    check_compatible,
    contribution_weights,
    pseudo_gradient,
    weighted_mean,
)
from tests.helpers.merge import hp_for, random_model

# --------------------------------------------------------------------------- check_compatible


def test_check_compatible_accepts_matching_tensors_and_specs() -> None:
    ref = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    check_compatible(ref, {"a": torch.ones(2, 3), "b": torch.ones(4)})
    check_compatible(ref, {"a": (torch.float32, (2, 3)), "b": (torch.float32, [4])})


def test_missing_key_is_named() -> None:
    with pytest.raises(MergeError, match=r"missing keys: a\.weight") as e:
        check_compatible({"a.weight": torch.zeros(2), "b": torch.zeros(1)}, {"b": torch.zeros(1)})
    assert e.value.details["missing"] == ["a.weight"]


def test_unexpected_key_is_named() -> None:
    with pytest.raises(MergeError, match=r"unexpected keys: extra\.bias") as e:
        check_compatible({"a": torch.zeros(1)}, {"a": torch.zeros(1), "extra.bias": torch.zeros(1)})
    assert e.value.details["unexpected"] == ["extra.bias"]


def test_shape_difference_is_named() -> None:
    with pytest.raises(MergeError, match=r"shape of b\.weight is \(3, 4\), expected \(4, 4\)") as e:
        check_compatible({"b.weight": torch.zeros(4, 4)}, {"b.weight": torch.zeros(3, 4)})
    assert e.value.details["shape"] == [["b.weight", [3, 4], [4, 4]]]


def test_dtype_difference_is_named() -> None:
    ref = {"w": torch.zeros(2)}
    with pytest.raises(MergeError, match=r"dtype of w is torch.float16, expected torch.float32"):
        check_compatible(ref, {"w": torch.zeros(2, dtype=torch.float16)})
    check_compatible(ref, {"w": torch.zeros(2, dtype=torch.float16)}, check_dtype=False)


def test_every_difference_is_listed_in_one_message() -> None:
    ref = {"a.weight": torch.zeros(1), "b.weight": torch.zeros(4, 4), "c": torch.zeros(2)}
    got = {"b.weight": torch.zeros(3, 4), "c": torch.zeros(2).double(), "d": torch.zeros(1)}
    with pytest.raises(MergeError) as e:
        check_compatible(ref, got, what="upload of p1")
    msg = str(e.value)
    assert msg.startswith("upload of p1 does not match the model: missing keys: a.weight")
    for part in (
        "unexpected keys: d",
        "shape of b.weight is (3, 4)",
        "dtype of c is torch.float64",
    ):
        assert part in msg
    assert set(e.value.details) == {"missing", "unexpected", "shape", "dtype"}


def test_long_lists_are_capped() -> None:
    ref = {f"layer.{i}": torch.zeros(1) for i in range(25)}
    with pytest.raises(MergeError, match=r"layer\.9 and 15 more") as e:
        check_compatible(ref, {})
    assert len(e.value.details["missing"]) == 25
    assert "layer.10" not in str(e.value)


# --------------------------------------------------------------------------- weighting


def test_pseudo_gradient_is_global_minus_local() -> None:
    g = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    loc = {"w": torch.tensor([0.75, 2.5]), "b": torch.tensor([0.0])}
    d = pseudo_gradient(g, loc)
    assert list(d) == ["w", "b"]
    assert torch.equal(d["w"], torch.tensor([0.25, -0.5])) and torch.equal(d["b"], torch.tensor([0.5]))
    with pytest.raises(MergeError, match="local weights does not match.*missing keys: b"):
        pseudo_gradient(g, {"w": loc["w"]})


def test_contribution_weights_tokens_and_uniform() -> None:
    assert contribution_weights({"a": 300, "b": 100}, "tokens") == {"a": 0.75, "b": 0.25}
    assert contribution_weights({"a": 300, "b": 100, "c": 0}, "uniform") == pytest.approx(
        {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}
    )
    assert contribution_weights({"a": 0, "b": 0}, "uniform") == {"a": 0.5, "b": 0.5}


@pytest.mark.parametrize(
    ("tokens", "mode", "match"),
    [
        ({}, "tokens", "no contributions"),
        ({"a": 10, "b": -1}, "tokens", "'b' has weight -1"),
        ({"a": 0, "b": 0}, "tokens", "0 tokens.*uniform"),
        ({"a": float("nan")}, "uniform", "'a' has weight nan"),
        ({"a": 1}, "by-size", "unknown weighting"),
    ],
)
def test_contribution_weights_refuses(tokens: dict, mode: str, match: str) -> None:
    with pytest.raises(MergeError, match=match):
        contribution_weights(tokens, mode)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- RunningSum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_running_sum_folded_tensor_by_tensor_equals_weighted_mean(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    deltas = [random_model(gen, dtype) for _ in range(4)]
    tokens = [512, 128, 0, 1024]
    acc = RunningSum(deltas[0])
    for d, w in zip(deltas, tokens, strict=True):
        for name in reversed(list(d)):  # a stream need not follow the model's key order
            acc.fold(name, d[name], w)
        acc.finish_contribution(w)
    assert acc.count == 4 and acc.total_weight == 1664
    got = acc.mean()
    want = weighted_mean(deltas, tokens)
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)


def test_running_sum_add_uniform_weights_and_reset_reuses_memory() -> None:
    gen = torch.Generator().manual_seed(2)
    deltas = [random_model(gen) for _ in range(3)]
    acc = RunningSum({k: (v.dtype, tuple(v.shape)) for k, v in deltas[0].items()})
    pointers: dict[str, int] = {}
    for rnd in range(2):
        w = contribution_weights({f"p{i}": 10 * (i + 1) for i in range(3)}, "uniform")
        for d, wi in zip(deltas, w.values(), strict=True):
            acc.add(d, wi)
        mean = acc.mean()
        pointers = pointers or {k: t.data_ptr() for k, t in mean.items()}
        assert {k: t.data_ptr() for k, t in mean.items()} == pointers  # same memory each round
        for k in mean:
            want = (deltas[0][k] + deltas[1][k] + deltas[2][k]) / 3
            torch.testing.assert_close(mean[k], want, rtol=1e-6, atol=1e-6)
        assert acc.mean() is not mean and acc.mean()["scale"] is mean["scale"]  # idempotent
        acc.reset()
        assert acc.count == 0 and acc.total_weight == 0.0
        assert acc.is_empty, f"round {rnd}"  # no contribution: written over next round
    assert acc.nbytes == 4 * (15 + 3 + 6 + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight", [1.0, 0.3, 7.0])
def test_a_first_contribution_is_written_as_it_is_and_sets_the_scale(dtype: torch.dtype, weight: float) -> None:
    gen = torch.Generator().manual_seed(5)
    first = {"w": torch.randn(4, 5, generator=gen).to(dtype), "b": torch.randn(7, generator=gen).to(dtype)}
    second = {k: torch.randn(v.shape, generator=gen).to(dtype) for k, v in first.items()}
    memory = {k: torch.full(v.shape, 123.0) for k, v in first.items()}  # stale values from an earlier round
    acc = RunningSum(first, storage=memory)  # they must not count
    acc.fold("w", first["w"], weight)
    acc.fold_part("b", 0, first["b"][:3], weight)  # in pieces: each piece written over
    acc.fold_part("b", 3, first["b"][3:], weight)
    acc.finish_contribution(weight)
    for k in first:  # the first contribution's values as they are: what adding into zeros gives
        assert torch.equal(acc.peek()[k], torch.zeros(first[k].shape).add_(first[k])), k
    acc.add(second, 2.0)
    tensors, divisor = acc.scaled()  # Σ wᵢΔᵢ / weight, and (weight + 2) / weight
    assert divisor == (weight + 2.0) / weight
    for k in first:
        want = torch.zeros(first[k].shape).add_(first[k]).add_(second[k], alpha=2.0 / weight)
        assert torch.equal(tensors[k], want), k
        mean = (first[k].double() * weight + second[k].double() * 2.0) / (weight + 2.0)
        torch.testing.assert_close(tensors[k] / divisor, mean.float(), rtol=1e-6, atol=1e-6)


def test_reset_undoes_a_first_contribution_that_failed_half_way() -> None:
    acc = RunningSum({"w": torch.zeros(6), "b": torch.zeros(2)})
    acc.fold_part("w", 0, torch.full((3,), 5.0), 1.0)
    acc.reset()
    acc.add({"w": torch.ones(6), "b": torch.ones(2)}, 1.0)
    assert acc.count == 1 and torch.equal(acc.mean()["w"], torch.ones(6))


def test_running_sum_refuses_bad_input() -> None:
    acc = RunningSum({"w": torch.zeros(2, 2), "b": torch.zeros(2)})
    with pytest.raises(MergeError, match="no contribution"):
        acc.mean()
    with pytest.raises(MergeError, match="unexpected key 'x'"):
        acc.fold("x", torch.zeros(2), 1.0)
    with pytest.raises(MergeError, match=r"shape of w is \(4,\), expected \(2, 2\)"):
        acc.fold("w", torch.zeros(4), 1.0)
    with pytest.raises(MergeError, match="must be floating point"):
        acc.fold("b", torch.zeros(2, dtype=torch.int64), 1.0)
    with pytest.raises(MergeError, match="weights must be finite and not negative"):
        acc.fold("b", torch.zeros(2), -1.0)
    acc.fold("b", torch.ones(2), 1.0)
    with pytest.raises(MergeError, match="b was folded twice"):
        acc.fold("b", torch.ones(2), 1.0)
    with pytest.raises(MergeError, match="incomplete: missing keys: w"):
        acc.finish_contribution(1.0)
    with pytest.raises(MergeError, match="half folded"):
        acc.mean()
    with pytest.raises(MergeError, match=r"dtype of w is torch.float64"):
        RunningSum({"w": torch.zeros(1)}).add({"w": torch.zeros(1, dtype=torch.float64)}, 1.0)
    zero = RunningSum({"w": torch.zeros(1)})
    zero.add({"w": torch.ones(1)}, 0.0)
    with pytest.raises(MergeError, match="total weight of 0"):
        zero.mean()
    done = RunningSum({"w": torch.zeros(1)})
    done.add({"w": torch.ones(1)}, 1.0)
    done.mean()
    with pytest.raises(MergeError, match="call reset"):
        done.add({"w": torch.ones(1)}, 1.0)


def test_weighted_mean_refuses_bad_input() -> None:
    with pytest.raises(MergeError, match="2 updates but 1 weights"):
        weighted_mean([{"w": torch.zeros(1)}, {"w": torch.zeros(1)}], [1.0])
    with pytest.raises(MergeError, match="update 1 does not match.*shape of w"):
        weighted_mean([{"w": torch.zeros(1)}, {"w": torch.zeros(2)}], [1.0, 1.0])


# --------------------------------------------------------------------------- hand-computed rounds
#
# One 2-element parameter θ₀ = [1, 2]; participant A processed 3 tokens, B 1 token, so
# w_A = 3/4, w_B = 1/4. Each round A and B send back θ_r − Δᵢ:
#   round 1: Δ_A = [0.4, 0.4], Δ_B = [0.8, 0.8] → g₁ = 3/4·0.4 + 1/4·0.8 = 0.3 + 0.2 = [0.5, 0.5]
#   round 2: Δ_A = [0.2, 0.0], Δ_B = [0.4, 0.04] → g₂ = [0.15 + 0.1, 0 + 0.01] = [0.25, 0.01]
# Hyperparameters are outer_defaults (hp_for): fedavg lr 1; diloco lr 0.7 (pinned) μ 0.9 Nesterov; fedavgm
# lr 1 μ 0.9; fedadam and fedyogi lr 0.01, β1 0.9, β2 0.99, eps 1e-3.

ROUND_DELTAS = [
    {"A": [0.4, 0.4], "B": [0.8, 0.8]},
    {"A": [0.2, 0.0], "B": [0.4, 0.04]},
]

HAND_COMPUTED = {
    # θ₁ = θ₀ − 1·g₁ = [0.5, 1.5];  θ₂ = θ₁ − 1·g₂ = [0.25, 1.49]
    "fedavg": ([0.5, 1.5], [0.25, 1.49]),
    # round 1: buf = g₁ = 0.5 (torch's first buffer is the gradient itself)
    #          step = g₁ + 0.9·buf = 0.5 + 0.45 = 0.95; θ₁ = θ₀ − 0.7·0.95 = θ₀ − 0.665
    # round 2: buf = 0.9·0.5 + g₂ = [0.70, 0.46]
    #          step = g₂ + 0.9·buf = [0.25 + 0.63, 0.01 + 0.414] = [0.88, 0.424]
    #          θ₂ = θ₁ − 0.7·step = [0.335 − 0.616, 1.335 − 0.2968]
    "diloco": ([0.335, 1.335], [-0.281, 1.0382]),
    # the delayed Nesterov step with its default N = 1 is DiLoCo's (test_delayed_nesterov.py: N > 1)
    "delayed_nesterov": ([0.335, 1.335], [-0.281, 1.0382]),
    # round 1: buf = 0.5, θ₁ = θ₀ − 0.5;  round 2: buf = 0.45 + g₂ = [0.70, 0.46], θ₂ = θ₁ − buf
    "fedavgm": ([0.5, 1.5], [-0.2, 1.04]),
    # torch Adam: m = 0.9m + 0.1g, v = 0.99v + 0.01g², θ −= lr/(1−0.9ᵗ) · m / (√(v/(1−0.99ᵗ)) + eps)
    # round 1: m = 0.05, v = 0.0025; √(0.0025/0.01) = 0.5
    #          θ −= 0.01/0.1 · 0.05 / 0.501 = 0.00998004  → θ₁ = [0.99001996, 1.99001996]
    # round 2 (1−0.9² = 0.19, 1−0.99² = 0.0199):
    #   x: m = 0.045 + 0.025 = 0.07,  v = 0.002475 + 0.000625 = 0.0031,
    #      √(0.0031/0.0199) = 0.39468835
    #      θ −= 0.01/0.19 · 0.07 / 0.39568835 = 0.00931089 → 0.98070907
    #   y: m = 0.045 + 0.001 = 0.046, v = 0.002475 + 0.000001 = 0.002476,
    #      √(0.002476/0.0199) = 0.35273518
    #      θ −= 0.01/0.19 · 0.046 / 0.35373518 = 0.00684425 → 1.98317571
    "fedadam": ([0.99001996, 1.99001996], [0.98070907, 1.98317571]),
    # Yogi, no bias correction, v₀ = eps² = 1e-6:
    # round 1: m = 0.05; g² = 0.25 > v₀ so v = 1e-6 + 0.01·0.25 = 0.002501, √v = 0.05001000
    #          θ −= 0.01·0.05 / 0.05101000 = 0.00980200 → θ₁ = [0.99019800, 1.99019800]
    # round 2:
    #   x: m = 0.07;  g² = 0.0625 > v so v = 0.002501 + 0.000625 = 0.003126, √v = 0.05591064
    #      θ −= 0.01·0.07 / 0.05691064 = 0.01229998 → 0.97789802
    #   y: m = 0.046; g² = 0.0001 < v so v = 0.002501 − 0.000001 = 0.0025,   √v = 0.05
    #      θ −= 0.01·0.046 / 0.051 = 0.00901961 → 1.98117839
    "fedyogi": ([0.99019800, 1.99019800], [0.97789802, 1.98117839]),
}


def run_round(outer: OuterOptimizer, acc: RunningSum, deltas: dict[str, list[float]], scaled: bool = False) -> None:
    tokens = {"A": 3, "B": 1}
    weights = contribution_weights(tokens, "tokens")
    acc.reset()
    for who, d in deltas.items():
        local = {"x": outer.params["x"] - torch.tensor(d)}
        acc.add(pseudo_gradient(outer.params, local), weights[who])
    if scaled:  # as the coordinator does: the step divides as it reads
        outer.step(*acc.scaled())
    else:
        outer.step(acc.mean())


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_two_rounds_match_hand_computed_values(algorithm: str, scaled: bool) -> None:
    outer = OuterOptimizer({"x": torch.tensor([1.0, 2.0])}, algorithm, hp_for(algorithm))
    acc = RunningSum(outer.params)
    for rnd, expected in enumerate(HAND_COMPUTED[algorithm]):
        run_round(outer, acc, ROUND_DELTAS[rnd], scaled)
        got = outer.params["x"]
        torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=5e-7)
    assert outer.steps == 2


@pytest.mark.parametrize("divisor", [1.0, 2.5, 0.4])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_step_with_a_divisor_is_bitwise_a_step_on_the_divided_delta(algorithm: str, divisor: float) -> None:
    gen = torch.Generator().manual_seed(11)
    start = random_model(gen)
    deltas = [random_model(gen) for _ in range(3)]
    divided = OuterOptimizer(start, algorithm, hp_for(algorithm))
    fused_in = OuterOptimizer(start, algorithm, hp_for(algorithm))
    for d in deltas:  # several steps, so that momentum and moments take part
        divided.step({k: v.clone().div_(divisor) for k, v in d.items()})
        fused_in.step({k: v.clone() for k, v in d.items()}, divisor)
        assert not hasattr(fused_in.optimizer, "grad_scale")
    for k in start:
        assert torch.equal(fused_in.params[k], divided.params[k]), k
    for k, v in divided.state_tensors().items():
        assert torch.equal(fused_in.state_tensors()[k], v), k


@pytest.mark.parametrize("divisor", [0.0, -1.0, float("nan"), float("inf")])
def test_step_refuses_a_bad_divisor(divisor: float) -> None:
    outer = OuterOptimizer({"x": torch.ones(3)}, "diloco", hp_for("diloco"))
    with pytest.raises(MergeError, match="divisor must be finite and positive"):
        outer.step({"x": torch.ones(3)}, divisor)
    assert torch.equal(outer.params["x"], torch.ones(3)) and outer.steps == 0


def test_scaled_sum_of_one_contribution_needs_no_division() -> None:
    acc = RunningSum({"w": torch.zeros(4)})
    acc.add({"w": torch.arange(4.0)}, 1234.0)
    tensors, divisor = acc.scaled()
    assert divisor == 1.0 and torch.equal(tensors["w"], torch.arange(4.0))
    with pytest.raises(MergeError, match="already taken"):
        acc.mean()  # handed over undivided: no mean of it any more
    acc.reset()
    acc.add({"w": torch.ones(4)}, 0.0)  # a first weight of 0 sets no scale: the values count as 0
    acc.add({"w": torch.full((4,), 3.0)}, 2.0)
    assert torch.equal(acc.mean()["w"], torch.full((4,), 3.0))


def test_fedavg_equals_token_weighted_mean_of_participant_weights() -> None:
    gen = torch.Generator().manual_seed(3)
    global_w = random_model(gen)
    locals_ = [random_model(gen) for _ in range(3)]
    tokens = {"p0": 1000, "p1": 250, "p2": 4000}
    outer = OuterOptimizer(global_w, "fedavg", hp_for("fedavg"))
    acc = RunningSum(global_w)
    for t, local in zip(tokens.values(), locals_, strict=True):
        acc.add(pseudo_gradient(outer.params, local), t)  # raw tokens: mean() normalises
    outer.step(acc.mean())
    for k in global_w:
        want = sum(t * loc[k] for t, loc in zip(tokens.values(), locals_, strict=True)) / 5250
        torch.testing.assert_close(outer.params[k], want, rtol=1e-5, atol=1e-6)
