"""Weighting and averaging of pseudo-gradients: the Σᵢ wᵢΔᵢ half of every merge.

Everything here is pure tensor math over `dict[str, Tensor]`. `check_compatible` is the
one place that compares an update with the model and says, in full, what differs.
The coordinator's constant-memory accumulator, `RunningSum`, lives in `running_sum.py`;
`weighted_mean` here is the naive reference it is tested against. `max_abs` and
`MAX_UPDATE_ABS` say how large a value an update may hold: finite is not enough, since
float32 values up to 3.4e38 are finite and an outer step squares (Adam) or adds up (Nesterov) what it is given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from fedtrain.errors import MergeError

TensorDict = dict[str, torch.Tensor]
TensorSpec = tuple[torch.dtype, tuple[int, ...]]
SpecLike = torch.Tensor | tuple[torch.dtype, Sequence[int]]

_MAX_LISTED = 10

#: The largest |value| a pseudo-gradient may hold. 2**60 (1.2e18) is 10^16 times any real
#: pseudo-gradient of a float32 model, and small enough that no outer step of a weighted mean
#: of such values can overflow float32 (3.4e38): Adam's and Yogi's second moment holds g²
#: (2**120 at most), Nesterov momentum g / (1 - momentum), and the weights move by lr times
#: those. The coordinator refuses an update with a larger value before it is merged.
MAX_UPDATE_ABS = 2.0**60


def _spec(value: SpecLike) -> TensorSpec:
    """The (dtype, shape) of a tensor or of an already given (dtype, shape) pair."""
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape)
    dtype, shape = value
    return dtype, tuple(int(s) for s in shape)


def _listed(items: Sequence[str]) -> str:
    """Join names for a message, capped so a huge model does not produce a huge error."""
    shown = ", ".join(items[:_MAX_LISTED])
    rest = len(items) - _MAX_LISTED
    return f"{shown} and {rest} more" if rest > 0 else shown


def _shape_str(shape: tuple[int, ...]) -> str:
    return str(tuple(shape))


def check_compatible(
    reference: Mapping[str, SpecLike],
    incoming: Mapping[str, SpecLike],
    *,
    what: str = "update",
    check_dtype: bool = True,
) -> None:
    """Raise MergeError listing every difference of `incoming` from `reference`.

    Values are tensors or (dtype, shape) pairs, so a safetensors header can be checked
    before any tensor data has arrived. `details` holds the lists: missing, unexpected,
    shape (name, got, expected) and dtype (name, got, expected).
    """
    missing = [k for k in reference if k not in incoming]
    unexpected = [k for k in incoming if k not in reference]
    shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    dtype: list[tuple[str, str, str]] = []
    for name, ref in reference.items():
        if name not in incoming:
            continue
        ref_dtype, ref_shape = _spec(ref)
        got_dtype, got_shape = _spec(incoming[name])
        if got_shape != ref_shape:
            shape.append((name, got_shape, ref_shape))
        if check_dtype and got_dtype != ref_dtype:
            dtype.append((name, str(got_dtype), str(ref_dtype)))
    if not (missing or unexpected or shape or dtype):
        return
    parts = []
    if missing:
        parts.append(f"missing keys: {_listed(missing)}")
    if unexpected:
        parts.append(f"unexpected keys: {_listed(unexpected)}")
    parts.extend(f"shape of {n} is {_shape_str(g)}, expected {_shape_str(e)}" for n, g, e in shape[:_MAX_LISTED])
    if len(shape) > _MAX_LISTED:
        parts.append(f"and {len(shape) - _MAX_LISTED} more shape differences")
    parts.extend(f"dtype of {n} is {g}, expected {e}" for n, g, e in dtype[:_MAX_LISTED])
    if len(dtype) > _MAX_LISTED:
        parts.append(f"and {len(dtype) - _MAX_LISTED} more dtype differences")
    details = {
        "missing": missing,
        "unexpected": unexpected,
        "shape": [[n, list(g), list(e)] for n, g, e in shape],
        "dtype": [[n, g, e] for n, g, e in dtype],
    }
    raise MergeError(f"{what} does not match the model: " + "; ".join(parts), details=details)


def pseudo_gradient(global_params: Mapping[str, torch.Tensor], local_params: Mapping[str, torch.Tensor]) -> TensorDict:
    """Δ = θ_global − θ_local for every tensor, in the key order of `global_params`."""
    check_compatible(global_params, local_params, what="local weights")
    return {k: g.detach() - local_params[k].detach() for k, g in global_params.items()}


def _check_weight(weight: float, who: str) -> float:
    w = float(weight)
    if not math.isfinite(w) or w < 0:
        raise MergeError(f"{who} has weight {weight!r}; weights must be finite and not negative")
    return w


def contribution_weights(
    tokens: Mapping[str, int | float], mode: Literal["tokens", "uniform"] = "tokens"
) -> dict[str, float]:
    """Normalised merge weights wᵢ (summing to 1): tokensᵢ / Σ tokens, or 1/n for "uniform"."""
    if not tokens:
        raise MergeError("no contributions to weigh: at least one participant must submit")
    if mode not in ("tokens", "uniform"):
        raise MergeError(f"unknown weighting {mode!r}; use 'tokens' or 'uniform'")
    counts = {k: _check_weight(v, f"participant {k!r}") for k, v in tokens.items()}
    if mode == "uniform":
        return {k: 1.0 / len(counts) for k in counts}
    total = sum(counts.values())
    if total <= 0:
        raise MergeError(
            "every participant reported 0 tokens, so token weighting is undefined; "
            "report tokens processed or use weighting 'uniform'"
        )
    return {k: v / total for k, v in counts.items()}


def weighted_mean(deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> TensorDict:
    """Naive reference Σ wᵢΔᵢ / Σ wᵢ over updates all held in memory (float32 or wider)."""
    if not deltas:
        raise MergeError("no updates to average")
    if len(deltas) != len(weights):
        raise MergeError(f"{len(deltas)} updates but {len(weights)} weights")
    ws = [_check_weight(w, f"update {i}") for i, w in enumerate(weights)]
    total = sum(ws)
    if total <= 0:
        raise MergeError("updates have a total weight of 0, so their mean is undefined")
    first = deltas[0]
    for i, d in enumerate(deltas[1:], start=1):
        check_compatible(first, d, what=f"update {i}")
    out: TensorDict = {}
    for name, ref in first.items():
        dtype = torch.promote_types(ref.dtype, torch.float32)
        acc = torch.zeros(ref.shape, dtype=dtype, device=ref.device)
        for w, d in zip(ws, deltas, strict=True):
            acc = acc + w * d[name].detach().to(dtype)
        out[name] = acc / total
    return out


def max_abs(t: torch.Tensor) -> float:
    """The largest |value| of `t` (0 for an empty or integer tensor); NaN or Inf when it holds
    one. One fused min/max reduction, the same pass as `all_finite`."""
    if not t.is_floating_point() or t.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(t.detach())
    low, high = float(lo), float(hi)
    if math.isnan(low) or math.isnan(high):
        return math.nan
    return max(-low, high)




def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in `t`. min and max propagate NaN and show Inf, and one fused reduction
    over the data is ~25x faster than materializing isfinite's boolean tensor."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
