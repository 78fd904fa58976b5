"""Robust aggregation: norm clipping, coordinate-wise median and trimmed mean, norm outliers.

Pure tensor math and pure decisions, no I/O. The coordinator reads spooled updates one
tensor at a time (see `coordinator/spool.py`) and hands each stack of k same-named tensors
to `aggregate_tensor`, so memory is k copies of one tensor, never k copies of a model.

- `clip_scale(norm, max_norm)`: the factor that scales an update down to `max_norm`
  (1.0 when it is already within); the caller multiplies the update's fold weight by it.
- `aggregate_tensor(stack, method, trim_fraction)`: coordinate-wise median (the mean of
  the two middle values for an even count, like numpy) or trimmed mean (drop
  ⌊trim·k⌋ values at each end of every coordinate, average the rest).
- `norm_outliers(norms, factor)`: which updates have a norm more than `factor` times the
  median norm, each with a reason; a decision, reported by the caller as an event.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import torch

from fedtrain.errors import MergeError

Method = Literal["mean", "median", "trimmed_mean"]
MIN_FOR_OUTLIERS = 3


def sum_of_squares(tensor: torch.Tensor) -> float:
    """Σ x² of one tensor, accumulated in float64 so that big models do not lose precision."""
    if tensor.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(tensor.detach(), dtype=torch.float64) ** 2)


def update_norm(tensors: Iterable[torch.Tensor]) -> float:
    """The L2 norm of a whole update: all its tensors taken as one vector."""
    return math.sqrt(sum(sum_of_squares(t) for t in tensors))


def clip_scale(norm: float, max_norm: float | None) -> float:
    """min(1, max_norm / norm): the factor that clips an update of `norm` to `max_norm`."""
    if max_norm is None or norm <= max_norm:
        return 1.0
    if max_norm <= 0 or not math.isfinite(norm):
        raise MergeError(f"cannot clip an update of norm {norm} to {max_norm}")
    return max_norm / norm


def clip_by_norm(delta: Mapping[str, torch.Tensor], max_norm: float) -> tuple[dict[str, torch.Tensor], float]:
    """A copy of `delta` scaled to norm at most `max_norm`, and the scale applied (reference)."""
    scale = clip_scale(update_norm(delta.values()), max_norm)
    return {k: v * scale for k, v in delta.items()}, scale


def trimmed_count(k: int, trim_fraction: float) -> int:
    """How many values are cut at each end of k for a trim fraction (always leaves one)."""
    if not 0 <= trim_fraction < 0.5:
        raise MergeError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    return min(math.floor(trim_fraction * k), (k - 1) // 2)


def aggregate_tensor(stack: Sequence[torch.Tensor], method: Method, trim_fraction: float = 0.1) -> torch.Tensor:
    """Combine k tensors of one name coordinate by coordinate, in float32 (or wider)."""
    if not stack:
        raise MergeError("no tensors to aggregate")
    shape = tuple(stack[0].shape)
    for t in stack[1:]:
        if tuple(t.shape) != shape:
            raise MergeError(f"cannot aggregate tensors of shapes {shape} and {tuple(t.shape)}")
    dtype = torch.promote_types(stack[0].dtype, torch.float32)
    x = torch.stack([t.detach().to(dtype) for t in stack])
    if method == "mean":
        return x.mean(dim=0)
    k = x.shape[0]
    if method == "median":
        ordered = x.sort(dim=0).values
        mid = k // 2
        return ordered[mid].clone() if k % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    if method == "trimmed_mean":
        cut = trimmed_count(k, trim_fraction)
        ordered = x.sort(dim=0).values
        return ordered[cut : k - cut].mean(dim=0)
    raise MergeError(f"unknown aggregator {method!r}; use mean, median or trimmed_mean")


def aggregate(
    deltas: Sequence[Mapping[str, torch.Tensor]], method: Method, trim_fraction: float = 0.1
) -> dict[str, torch.Tensor]:
    """Every tensor of in-memory updates combined by `aggregate_tensor` (reference for tests)."""
    if not deltas:
        raise MergeError("no updates to aggregate")
    return {name: aggregate_tensor([d[name] for d in deltas], method, trim_fraction) for name in deltas[0]}


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def norm_outliers(norms: Mapping[str, float], factor: float | None) -> dict[str, str]:
    """Updates whose norm exceeds `factor` × the median norm of all of them, each with a reason.

    Needs at least MIN_FOR_OUTLIERS updates (with two there is no telling which one is
    odd); never rejects so many that fewer than half remain.
    """
    if factor is None or len(norms) < MIN_FOR_OUTLIERS:
        return {}
    median = _median(list(norms.values()))
    limit = factor * median
    far = {k: n for k, n in norms.items() if n > limit or not math.isfinite(n)}
    if len(norms) - len(far) < (len(norms) + 1) // 2:
        return {}
    return {
        k: f"update norm {n:.4g} is more than {factor:g} x the median norm {median:.4g} of {len(norms)} updates"
        for k, n in sorted(far.items())
    }
