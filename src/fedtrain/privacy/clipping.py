"""Differential privacy's two pieces of tensor math: L2 clipping of an update and Gaussian noise.

Clipping is over the whole sync set of a round (every tensor of the update as one vector), so each
participant's contribution has L2 norm ≤ C. The aggregate is a token-weighted mean Σ wᵢΔᵢ, so one
participant moves it by at most w_max·C (weights are public: token counts travel in the clear),
and the Gaussian mechanism adds noise of standard deviation σ·w_max·C to it — for equal weights
σC/N on the mean, i.e. σC on the sum, the usual DP-FedAvg calibration (McMahan et al. 2018).

*Central* noise: the coordinator adds N(0, (σ w_max C)²) to each coordinate of the unmasked mean.

*Distributed* noise (with secure aggregation, so the coordinator never sees an un-noised sum):
each participant adds N(0, (σ w_max C)² / n_min) to its weighted, clipped contribution before
fixed-point encoding and masking. The survivors' noises add up to variance
|S| (σ w_max C)² / n_min ≥ (σ w_max C)² as long as |S| ≥ n_min: the round must be refused below
n_min survivors (`distributed_noise_ok`), and each dropout above it only costs accuracy (more
noise than needed, |S|/n_min times the variance). Against a coordinator colluding with c
participants (who know their own noise), the remaining noise has variance (|S| − c)/n_min of the
target: pick n_min ≤ |S| − c for the guarantee to hold against c colluders. Rounding to the ring
grid adds a little more noise, never less.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedtrain.errors import ConfigError


def l2_norm(update: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of every floating tensor of `update` taken as one vector (float64 accumulation)."""
    total = 0.0
    for t in update.values():
        if t.is_floating_point():
            total += float(t.detach().to(torch.float64).square().sum())
    return math.sqrt(total)


def clip_update(update: Mapping[str, torch.Tensor], max_norm: float) -> tuple[dict[str, torch.Tensor], float]:
    """(update scaled so its L2 norm is at most `max_norm`, its norm before clipping)."""
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise ConfigError(f"the clipping norm C must be a positive finite number, got {max_norm}")
    norm = l2_norm(update)
    if not math.isfinite(norm):
        raise ConfigError("an update to clip holds NaN or Inf")
    factor = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return {n: (t * factor if t.is_floating_point() else t) for n, t in update.items()}, norm


def clip_within(update: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    """`update` itself when its L2 norm is at most `max_norm`, else scaled copies (`clip_update`):
    a participant's clip before encoding, which must leave its Δ as it is."""
    norm = l2_norm(update)
    if math.isfinite(norm) and norm <= max_norm:
        return update
    return clip_update(update, max_norm)[0]


def noise_std(noise_multiplier: float, max_norm: float, max_weight: float) -> float:
    """σ · w_max · C: the standard deviation the aggregate's noise must have in total."""
    if noise_multiplier < 0 or not 0 < max_weight <= 1:
        raise ConfigError(f"need σ >= 0 and 0 < w_max <= 1, got σ={noise_multiplier}, w_max={max_weight}")
    return noise_multiplier * max_weight * max_norm


def distributed_std(noise_multiplier: float, max_norm: float, max_weight: float, n_min: int) -> float:
    """Each participant's share of the noise: σ w_max C / √n_min (variance split n_min ways)."""
    if n_min < 1:
        raise ConfigError(f"the minimum number of survivors n_min must be at least 1, got {n_min}")
    return noise_std(noise_multiplier, max_norm, max_weight) / math.sqrt(n_min)


def distributed_noise_ok(survivors: int, n_min: int) -> tuple[bool, str]:
    """Whether a round whose participants each added 1/n_min of the noise variance may be published."""
    if survivors >= n_min:
        return True, f"{survivors} survivors >= n_min = {n_min}: the sum holds at least the promised noise"
    return False, (
        f"only {survivors} survivors, fewer than n_min = {n_min}: their noise adds up to {survivors}/{n_min} "
        "of the promised variance, so the round is refused"
    )


def add_noise(
    tensors: Mapping[str, torch.Tensor], std: float, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """Each floating tensor plus i.i.d. N(0, std²) noise (central: on the mean; distributed: on a
    participant's weighted contribution before encoding). Pass a generator seeded from the OS
    CSPRNG in production; tests pass a seeded one."""
    if not (math.isfinite(std) and std >= 0):
        raise ConfigError(f"a noise standard deviation is finite and >= 0, got {std}")
    out = {}
    for name, t in tensors.items():
        if t.is_floating_point() and std > 0:
            noise = torch.randn(t.shape, generator=generator, dtype=torch.float64) * std
            out[name] = (t.to(torch.float64) + noise).to(t.dtype)
        else:
            out[name] = t
    return out


def private_contribution(
    update: Mapping[str, torch.Tensor],
    weight: float,
    max_norm: float,
    std: float,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """A participant's distributed-DP contribution: `weight · clip(update, C)` plus its share of
    the noise (`distributed_std`), in float64. Encode it with weight 1 (`FixedPoint.encode(t, 1.0)`):
    the weight is already in, and the noise must not be scaled by it."""
    if not 0.0 <= weight <= 1.0:
        raise ConfigError(f"a token weight is in [0, 1], got {weight}")
    clipped, _ = clip_update(update, max_norm)
    weighted = {n: (t.to(torch.float64) * weight if t.is_floating_point() else t) for n, t in clipped.items()}
    return add_noise(weighted, std, generator)
