"""Unit tests of the outer optimizers: against naive references, their torch wiring, Yogi's
state, and save/restore bit for bit."""


import math

import pytest
import torch

from fedtrain.errors import MergeError
from fedtrain.merge import (
    ALGORITHMS,
    OuterOptimizer,
    Yogi,
    build_torch_optimizer,
)
from tests.helpers.merge import hp_for, random_model, roundtrip

# --------------------------------------------------------------------------- naive references


def naive_nesterov(theta: list[float], grads: list[list[float]], lr: float, mu: float) -> list[float]:
    """Plain-Python SGD with Nesterov momentum as torch defines it (first buffer = gradient)."""
    theta = list(theta)
    buf: list[float] | None = None
    for g in grads:
        buf = list(g) if buf is None else [mu * b + gi for b, gi in zip(buf, g, strict=True)]
        theta = [t - lr * (gi + mu * b) for t, gi, b in zip(theta, g, buf, strict=True)]
    return theta


def naive_yogi(
    theta: list[float], grads: list[list[float]], lr: float, b1: float, b2: float, eps: float
) -> list[float]:
    """Plain-Python Yogi of Reddi et al. Algorithm 2 (v₀ = eps², no bias correction)."""
    theta = list(theta)
    m = [0.0] * len(theta)
    v = [eps * eps] * len(theta)
    for g in grads:
        for i, gi in enumerate(g):
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = v[i] - (1 - b2) * gi * gi * math.copysign(1.0, v[i] - gi * gi)
            theta[i] -= lr * m[i] / (math.sqrt(v[i]) + eps)
    return theta


@pytest.mark.parametrize(("algorithm", "reference"), [("diloco", "nesterov"), ("fedyogi", "yogi")])
def test_outer_optimizer_matches_naive_reference(algorithm: str, reference: str) -> None:
    gen = torch.Generator().manual_seed(4)
    theta0 = torch.randn(7, generator=gen, dtype=torch.float64)
    grads = [torch.randn(7, generator=gen, dtype=torch.float64) for _ in range(5)]
    hp = hp_for(algorithm)
    outer = OuterOptimizer({"w": theta0}, algorithm, hp)
    for g in grads:
        outer.step({"w": g.float()})
    gl = [g.float().double().tolist() for g in grads]
    if reference == "nesterov":
        want = naive_nesterov(theta0.tolist(), gl, hp["lr"], hp["momentum"])
    else:
        want = naive_yogi(theta0.tolist(), gl, hp["lr"], hp["beta1"], hp["beta2"], hp["eps"])
    torch.testing.assert_close(
        outer.params["w"].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5
    )


# --------------------------------------------------------------------------- optimizer wiring


def test_build_torch_optimizer_uses_torch_with_config_values() -> None:
    p = [torch.zeros(2)]
    sgd = build_torch_optimizer(p, "fedavg", hp_for("fedavg", momentum=0.5))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.0
    dil = build_torch_optimizer(p, "diloco", hp_for("diloco")).defaults
    assert (dil["lr"], dil["momentum"], dil["nesterov"]) == (0.7, 0.9, True)
    avgm = build_torch_optimizer(p, "fedavgm", hp_for("fedavgm")).defaults
    assert (avgm["lr"], avgm["momentum"], avgm["nesterov"]) == (1.0, 0.9, False)
    adam = build_torch_optimizer(p, "fedadam", hp_for("fedadam", beta2=0.999))
    assert isinstance(adam, torch.optim.Adam)
    assert adam.defaults["betas"] == (0.9, 0.999) and adam.defaults["eps"] == 1e-3
    assert isinstance(build_torch_optimizer(p, "fedyogi", hp_for("fedyogi")), Yogi)


def test_build_torch_optimizer_refuses_bad_settings() -> None:
    with pytest.raises(MergeError, match="unknown outer algorithm 'sgd'; choose one of fedavg"):
        build_torch_optimizer([torch.zeros(1)], "sgd", {"lr": 1.0})
    with pytest.raises(MergeError, match="lack momentum, nesterov"):
        build_torch_optimizer([torch.zeros(1)], "diloco", {"lr": 1.0})
    with pytest.raises(MergeError, match="diloco cannot be built: .*[Nn]esterov"):
        build_torch_optimizer([torch.zeros(1)], "diloco", hp_for("diloco", momentum=0.0))


def test_step_hands_delta_to_torch_without_copy_and_clears_grad() -> None:
    source = {"w": torch.ones(3, dtype=torch.bfloat16)}
    outer = OuterOptimizer(source, "diloco", hp_for("diloco"))
    assert outer.params["w"].dtype == torch.float32
    outer.params["w"].add_(1.0)
    assert float(source["w"][0]) == 1.0  # master weights are a copy, not the caller's tensor
    delta = {"w": torch.full((3,), 0.5)}
    seen: list[int] = []
    torch_step = outer.optimizer.step

    def spy() -> None:
        seen.append(outer.params["w"].grad.data_ptr())  # type: ignore[union-attr]
        torch_step()

    outer.optimizer.step = spy  # type: ignore[method-assign,assignment]
    outer.step(delta)
    assert seen == [delta["w"].data_ptr()]
    assert outer.params["w"].grad is None and outer.steps == 1
    outer.step({"w": torch.full((3,), 0.5, dtype=torch.bfloat16)})  # cast, not refused
    assert outer.steps == 2


def test_step_refuses_bad_delta_and_leaves_weights_untouched() -> None:
    outer = OuterOptimizer({"a": torch.ones(2), "b": torch.ones(1)}, "fedadam", hp_for("fedadam"))
    before = {k: v.clone() for k, v in outer.params.items()}
    bad = [
        ({"a": torch.zeros(2)}, "missing keys: b"),
        ({"a": torch.zeros(3), "b": torch.zeros(1)}, r"shape of a is \(3,\)"),
        ({"a": torch.zeros(2), "b": torch.zeros(1, dtype=torch.int32)}, "b has dtype torch.int32"),
        ({"a": torch.zeros(2), "b": torch.tensor([float("inf")])}, "of b has NaN or infinite"),
    ]
    for delta, match in bad:
        with pytest.raises(MergeError, match=match):
            outer.step(delta)
    assert outer.steps == 0 and not outer.optimizer.state
    assert all(torch.equal(outer.params[k], before[k]) for k in before)


def test_yogi_state_is_tensors_and_second_moment_starts_at_eps_squared() -> None:
    p = torch.zeros(3)
    opt = Yogi([p], lr=0.1, eps=1e-2)
    p.grad = torch.tensor([0.0, 1e-3, 2.0])
    opt.step()
    st = opt.state_dict()["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and float(st["step"]) == 1.0
    # element 0: g = 0 leaves v = eps² = 1e-4; element 1: g² = 1e-6 < 1e-4 so v = 1e-4 − 1e-8
    # element 2: g² = 4 > 1e-4 so v = 1e-4 + 0.01·4 = 0.0401
    torch.testing.assert_close(st["exp_avg_sq"], torch.tensor([1e-4, 1e-4 - 1e-8, 0.0401]))
    with pytest.raises(ValueError, match="invalid betas"):
        Yogi([p], betas=(0.9, 1.0))


# --------------------------------------------------------------------------- save / restore


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_save_restore_continues_bitwise_identically(algorithm: str) -> None:
    gen = torch.Generator().manual_seed(5)
    start = random_model(gen)
    deltas = [{k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in start.items()} for _ in range(3)]
    hp = hp_for(algorithm)
    straight = OuterOptimizer(start, algorithm, hp)
    for d in deltas:
        straight.step({k: v.clone() for k, v in d.items()})
    stopped = OuterOptimizer(start, algorithm, hp)
    for d in deltas[:2]:
        stopped.step({k: v.clone() for k, v in d.items()})
    resumed = roundtrip(stopped)
    assert (resumed.algorithm, resumed.hp, resumed.steps) == (algorithm, hp, 2)
    resumed.step({k: v.clone() for k, v in deltas[2].items()})
    assert resumed.steps == 3
    for k in start:
        assert torch.equal(resumed.params[k], straight.params[k]), k
    a, b = resumed.state_tensors(), straight.state_tensors()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_state_tensor_names() -> None:
    outer = OuterOptimizer({"layer.weight": torch.ones(2)}, "fedadam", hp_for("fedadam"))
    assert outer.state_tensors() == {}
    outer.step({"layer.weight": torch.ones(2)})
    assert set(outer.state_tensors()) == {
        "step/layer.weight",
        "exp_avg/layer.weight",
        "exp_avg_sq/layer.weight",
    }
    sgd = OuterOptimizer({"layer.weight": torch.ones(2)}, "diloco", hp_for("diloco"))
    sgd.step({"layer.weight": torch.ones(2)})
    assert set(sgd.state_tensors()) == {"momentum_buffer/layer.weight"}
    meta = sgd.state_metadata()
    assert all(isinstance(v, str) for v in meta.values()) and meta["steps"] == "1"


def test_restore_refuses_missing_or_inconsistent_state() -> None:
    outer = OuterOptimizer({"a": torch.ones(2), "b": torch.ones(3)}, "diloco", hp_for("diloco"))
    outer.step({"a": torch.ones(2), "b": torch.ones(3)})
    params, tensors, meta = dict(outer.params), dict(outer.state_tensors()), outer.state_metadata()
    cases = [
        (params, tensors, {k: v for k, v in meta.items() if k != "hp"}, "metadata lacks hp"),
        (params, tensors, {**meta, "algorithm": "sgd"}, "unknown outer algorithm 'sgd'"),
        (params, tensors, {**meta, "hp": "{not json"}, "metadata is corrupt"),
        (params, tensors, {**meta, "format": "other/9"}, "format 'other/9'"),
        ({"a": params["a"]}, tensors, meta, "missing keys: b"),
        (
            params,
            {"momentum_buffer/a": tensors["momentum_buffer/a"]},
            meta,
            "should hold 2 tensors, found 1; missing momentum_buffer/b",
        ),
        (params, {**tensors, "exp_avg/a": torch.ones(2)}, meta, "unexpected tensor 'exp_avg/a'"),
        (params, {**tensors, "momentum_buffer/b": torch.ones(4)}, meta, "has shape"),
        (params, {}, meta, "after 1 steps should hold 2 tensors, found 0"),
    ]
    for p, t, m, match in cases:
        with pytest.raises(MergeError, match=match):
            OuterOptimizer.restore(p, t, m)
