"""The delayed Nesterov outer step of asynchronous mode (`merge/delayed.py`) against a
hand-written reference and hand-computed values, its N = 1 case against DiLoCo's step bit for
bit, a cycle of N updates against one synchronous Nesterov step, and its state through a
checkpoint (a resume mid-cycle continues bit for bit) and through a switch of algorithm."""

from __future__ import annotations

import pytest
import torch

from fedtrain.merge import OuterOptimizer
from fedtrain.merge.delayed import DelayedNesterov
from tests.helpers.merge import hp_for, random_model, roundtrip

HP = hp_for("delayed_nesterov")  # lr 0.7, momentum 0.9 (DiLoCo's)


def reference(theta: list[float], grads: list[list[float]], every: list[int], lr: float, beta: float) -> list[float]:
    """Plain Python, as Liu et al. write it (momentum activation 0): Δ ← Δ + g/N; every N-th
    update m ← βm + Δ, θ ← θ − η(g/N + βm), Δ ← 0; else θ ← θ − η·g/N."""
    theta = list(theta)
    m = [0.0] * len(theta)
    buf = [0.0] * len(theta)
    count = 0
    for g, n in zip(grads, every, strict=True):
        step = [gi / n for gi in g]
        buf = [b + s for b, s in zip(buf, step, strict=True)]
        count += 1
        if count >= n:
            m = [beta * mi + b for mi, b in zip(m, buf, strict=True)]
            theta = [t - lr * (s + beta * mi) for t, s, mi in zip(theta, step, m, strict=True)]
            buf, count = [0.0] * len(theta), 0
        else:
            theta = [t - lr * s for t, s in zip(theta, step, strict=True)]
    return theta


def run(start: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], every: list[int],
        algorithm: str = "delayed_nesterov") -> OuterOptimizer:
    outer = OuterOptimizer(start, algorithm, HP)
    for g, n in zip(grads, every, strict=True):
        outer.step({k: v.clone() for k, v in g.items()}, every=n)
    return outer


def test_four_updates_match_hand_computed_values() -> None:
    # θ₀ = [1, 2], N = 2, η = 0.7, β = 0.9:
    # 1: g/N = [0.25, 0.25], Δ = [0.25, 0.25], plain:    θ₁ = θ₀ − 0.7·0.25 = [0.825, 1.825]
    # 2: g/N = [0.125, 0.005], Δ = [0.375, 0.255], m = Δ:
    #    θ₂ = θ₁ − 0.7·(g/N + 0.9·m) = θ₁ − 0.7·[0.4625, 0.2345] = [0.50125, 1.66085]
    # 3: g/N = [0.05, −0.1], Δ = g/N, plain:             θ₃ = [0.46625, 1.73085]
    # 4: g/N = [0.15, 0.05], Δ = [0.2, −0.05], m = 0.9·[0.375, 0.255] + Δ = [0.5375, 0.1795]
    #    θ₄ = θ₃ − 0.7·[0.15 + 0.48375, 0.05 + 0.16155] = [0.022625, 1.582765]
    grads = [[0.5, 0.5], [0.25, 0.01], [0.1, -0.2], [0.3, 0.1]]
    outer = OuterOptimizer({"x": torch.tensor([1.0, 2.0])}, "delayed_nesterov", HP)
    expected = [[0.825, 1.825], [0.50125, 1.66085], [0.46625, 1.73085], [0.022625, 1.582765]]
    for g, want in zip(grads, expected, strict=True):
        outer.step({"x": torch.tensor(g)}, every=2)
        torch.testing.assert_close(outer.params["x"], torch.tensor(want), rtol=0, atol=5e-7)
    assert reference([1.0, 2.0], grads, [2] * 4, 0.7, 0.9) == pytest.approx(expected[-1], abs=1e-12)


@pytest.mark.parametrize("every", [[1] * 7, [3] * 7, [2, 2, 4, 4, 4, 4, 1], [5, 5, 2, 3, 3, 3, 3]])
def test_matches_the_plain_python_reference(every: list[int]) -> None:
    gen = torch.Generator().manual_seed(3)
    start = {"w": torch.randn(6, generator=gen)}
    grads = [{"w": 0.3 * torch.randn(6, generator=gen)} for _ in every]
    outer = run(start, grads, every)
    want = reference(start["w"].tolist(), [g["w"].tolist() for g in grads], every, HP["lr"], HP["momentum"])
    torch.testing.assert_close(outer.params["w"], torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_with_n_of_one_it_is_dilocos_nesterov_step_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(7)
    start = random_model(gen)
    grads = [random_model(gen) for _ in range(5)]
    delayed, diloco = run(start, grads, [1] * 5), run(start, grads, [1] * 5, algorithm="diloco")
    for k in start:
        assert torch.equal(delayed.params[k], diloco.params[k]), k
        m = f"momentum_buffer/{k}"
        assert torch.equal(delayed.state_tensors()[m], diloco.state_tensors()[m])


def test_a_cycle_of_n_updates_is_one_synchronous_nesterov_step_on_their_mean() -> None:
    gen = torch.Generator().manual_seed(9)
    start = random_model(gen)
    cycle = [random_model(gen) for _ in range(4)]
    delayed = run(start, cycle, [4] * 4)
    sync = OuterOptimizer(start, "diloco", HP)
    sync.step({k: sum(g[k] for g in cycle) / 4 for k in start})
    for k in start:
        torch.testing.assert_close(delayed.params[k], sync.params[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(delayed.state_tensors()[f"momentum_buffer/{k}"],
                                   sync.state_tensors()[f"momentum_buffer/{k}"], rtol=1e-5, atol=1e-6)


def test_between_momentum_steps_the_momentum_does_not_move() -> None:
    outer = OuterOptimizer({"x": torch.zeros(3)}, "delayed_nesterov", HP)
    outer.step({"x": torch.ones(3)}, every=3)
    state = outer.state_tensors()
    assert torch.equal(state["momentum_buffer/x"], torch.zeros(3))
    assert torch.equal(state["delay_buffer/x"], torch.full((3,), 1 / 3))
    assert state["delay_count/x"].item() == 1.0
    torch.testing.assert_close(outer.params["x"], torch.full((3,), -0.7 / 3))  # plain SGD at lr 0.7 on g/N


def test_a_smaller_n_takes_the_momentum_step_at_once() -> None:
    outer = OuterOptimizer({"x": torch.zeros(2)}, "delayed_nesterov", HP)
    for _ in range(2):
        outer.step({"x": torch.ones(2)}, every=4)
    outer.step({"x": torch.ones(2)}, every=2)  # three buffered now, N fell to 2: momentum step
    state = outer.state_tensors()
    assert state["delay_count/x"].item() == 0.0 and torch.equal(state["delay_buffer/x"], torch.zeros(2))
    torch.testing.assert_close(state["momentum_buffer/x"], torch.full((2,), 0.25 + 0.25 + 0.5))


def test_a_checkpoint_mid_cycle_resumes_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(5)
    start = random_model(gen)
    grads = [random_model(gen) for _ in range(7)]
    straight = run(start, grads, [3] * 7)
    stopped = run(start, grads[:4], [3] * 4)  # one update into the second cycle
    resumed = roundtrip(stopped)
    assert (resumed.algorithm, resumed.steps) == ("delayed_nesterov", 4)
    for g in grads[4:]:
        resumed.step({k: v.clone() for k, v in g.items()}, every=3)
    for k in start:
        assert torch.equal(resumed.params[k], straight.params[k]), k
    a, b = resumed.state_tensors(), straight.state_tensors()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_switching_from_and_to_diloco_keeps_the_momentum() -> None:
    gen = torch.Generator().manual_seed(2)
    start = random_model(gen)
    diloco = run(start, [random_model(gen) for _ in range(2)], [1, 1], algorithm="diloco")
    momentum = {k: v.clone() for k, v in diloco.state_tensors().items()}
    delayed = diloco.switched("delayed_nesterov", HP)
    assert delayed.algorithm == "delayed_nesterov" and delayed.steps == 2
    state = delayed.state_tensors()
    for k in start:
        assert torch.equal(state[f"momentum_buffer/{k}"], momentum[f"momentum_buffer/{k}"])
        assert torch.equal(state[f"delay_buffer/{k}"], torch.zeros_like(start[k]))
        assert torch.equal(delayed.params[k], diloco.params[k])
    delayed.step(random_model(gen), every=3)  # one update buffered: dropped on the way back
    back = roundtrip(delayed).switched("diloco", HP)
    assert set(back.state_tensors()) == {f"momentum_buffer/{k}" for k in start}
    for k in start:
        assert torch.equal(back.state_tensors()[f"momentum_buffer/{k}"], momentum[f"momentum_buffer/{k}"])
    fresh = OuterOptimizer(start, "diloco", HP).switched("delayed_nesterov", HP)
    assert fresh.steps == 0 and fresh.state_tensors() == {}
    assert OuterOptimizer(start, "fedadam", hp_for("fedadam")).switched("delayed_nesterov", HP).steps == 0


@pytest.mark.parametrize(("kwargs", "match"), [({"momentum": 0.0}, "momentum"), ({"momentum": 1.0}, "momentum"),
                                               ({"every": 0}, "every"), ({"lr": -1.0}, "learning rate")])
def test_bad_hyperparameters_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DelayedNesterov([torch.zeros(2)], **{"lr": 0.7, "momentum": 0.9, **kwargs})
    outer = OuterOptimizer({"x": torch.zeros(2)}, "delayed_nesterov", HP)
    with pytest.raises(ValueError, match="every"):
        outer.step({"x": torch.ones(2)}, every=0)
