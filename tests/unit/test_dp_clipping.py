"""Clipping bounds an update's L2 norm over the whole sync set; the noise has the standard deviation
the Gaussian mechanism asks, whether added centrally or split among n_min participants."""

from __future__ import annotations

import math

import pytest
import torch

from fedtrain.errors import ConfigError
from fedtrain.privacy.clipping import (
    add_noise,
    clip_update,
    distributed_noise_ok,
    distributed_std,
    l2_norm,
    noise_std,
    private_contribution,
)


def _update(seed: int, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(40, 30, generator=g) * scale,
        "b": (torch.randn(30, generator=g) * scale).to(torch.bfloat16),
        "step": torch.tensor([7], dtype=torch.int64),
    }


@pytest.mark.parametrize("seed, scale, c", [(0, 1.0, 0.5), (1, 0.001, 0.5), (2, 10.0, 3.0), (3, 1.0, 34.0)])
def test_clipping_bounds_the_norm_over_the_whole_update(seed: int, scale: float, c: float) -> None:
    update = _update(seed, scale)
    clipped, before = clip_update(update, c)
    assert before == pytest.approx(l2_norm(update))
    assert l2_norm(clipped) <= c * (1 + 1e-2)  # bf16 rounding of the scaled bias
    assert torch.equal(clipped["step"], update["step"])  # integer tensors are not part of the update
    if before <= c:
        assert all(torch.equal(clipped[n], update[n]) for n in update)
    else:
        assert l2_norm(clipped) == pytest.approx(c, rel=1e-2)
        cos = torch.nn.functional.cosine_similarity(clipped["w"].flatten(), update["w"].flatten(), dim=0)
        assert float(cos) == pytest.approx(1.0, abs=1e-6)  # the direction is kept


def test_clipping_refuses_bad_input() -> None:
    with pytest.raises(ConfigError):
        clip_update({"w": torch.ones(3)}, 0.0)
    with pytest.raises(ConfigError, match="NaN"):
        clip_update({"w": torch.tensor([float("nan")])}, 1.0)


def test_central_noise_has_the_mechanisms_std() -> None:
    std = noise_std(1.2, max_norm=0.5, max_weight=0.25)
    assert std == pytest.approx(1.2 * 0.5 * 0.25)
    noisy = add_noise({"w": torch.zeros(200_000)}, std, torch.Generator().manual_seed(0))["w"]
    assert float(noisy.std()) == pytest.approx(std, rel=0.02)
    assert float(noisy.mean()) == pytest.approx(0.0, abs=4 * std / math.sqrt(200_000))


@pytest.mark.parametrize("n_min, survivors", [(4, 4), (4, 6), (3, 3)])
def test_distributed_noise_adds_up_to_at_least_the_central_variance(n_min: int, survivors: int) -> None:
    sigma, c, w_max = 0.8, 1.0, 0.2
    each = distributed_std(sigma, c, w_max, n_min)
    g = torch.Generator().manual_seed(n_min * 10 + survivors)
    total = sum(add_noise({"w": torch.zeros(100_000)}, each, g)["w"] for _ in range(survivors))
    target = noise_std(sigma, c, w_max)
    assert float(total.var()) == pytest.approx(target**2 * survivors / n_min, rel=0.03)
    assert distributed_noise_ok(survivors, n_min)[0]


def test_too_few_survivors_for_distributed_noise_is_refused_with_the_reason() -> None:
    ok, reason = distributed_noise_ok(3, 4)
    assert not ok and "3/4" in reason and "refused" in reason


def test_a_private_contribution_is_weighted_clipped_and_noised() -> None:
    update = {"w": torch.full((50_000,), 1.0)}  # norm 223.6
    out = private_contribution(update, 0.5, max_norm=2.0, std=0.0)
    assert l2_norm(out) == pytest.approx(0.5 * 2.0)
    noisy = private_contribution(update, 0.5, max_norm=2.0, std=0.01, generator=torch.Generator().manual_seed(1))
    assert float((noisy["w"] - out["w"]).std()) == pytest.approx(0.01, rel=0.03)
    with pytest.raises(ConfigError):
        private_contribution(update, 1.5, 2.0, 0.0)


@pytest.mark.parametrize("args", [(-1.0, 1.0, 0.5), (1.0, 1.0, 0.0), (1.0, 1.0, 1.5)])
def test_noise_parameters_are_checked(args: tuple[float, float, float]) -> None:
    with pytest.raises(ConfigError):
        noise_std(*args)
    with pytest.raises(ConfigError):
        distributed_std(1.0, 1.0, 0.5, 0)
    with pytest.raises(ConfigError):
        add_noise({"w": torch.zeros(2)}, float("nan"))
