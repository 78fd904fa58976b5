"""Fixed-point encoding of updates into the ring Z_{2^b}, and the rule that keeps their sum from wrapping.

A participant's contribution to one coordinate is `w · clamp(Δ, −R, R)`: its update clipped to
the per-coordinate range [−R, R] and weighted by its token share w ∈ [0, 1] (the weights of a
round sum to 1, so the ring sum *is* the token-weighted mean, and token counts travel in the
clear). It is encoded at the public scale s = (2^p − 1)/R, rounded to the nearest integer, so
every contribution is an integer e with |e| ≤ 2^p − 1 ("p bits of precision" plus a sign), and
reduced mod 2^b.

The sum of N such integers has |Σe| ≤ N(2^p − 1) < 2^(⌈log2 N⌉ + p), so it reads back
exactly, as a signed value centred on 0, when

    b ≥ ⌈log2 N⌉ + p + 1                                  (`required_ring_bits`)

whatever the weights are (honest weights make |Σe| ≤ 2^p − 1 + N/2, far inside it; the rule
also covers a participant that lies about its weight, which can then spoil the mean but never
make it wrap). Rings are 2^16 or 2^32 (numpy uint16/uint32, whose addition is modular by
definition). With int8-level precision (p = 7, |e| ≤ 127, one sign bit) a 2^16 ring holds
N ≤ 2^(16−1−7) = 256 participants at 2 bytes a parameter; past that the ring is 2^32.
`FixedPoint.plan` picks the smallest ring that gives at least the asked precision for n_max
and then spends every spare bit on precision (the wire cost is the ring's, not p's).

Values are rounded in float32 (float64 past 22 bits of precision), one tensor at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedtrain.errors import ConfigError

RING_BITS = (16, 32)
#: An int8 value's magnitude bits: |q| ≤ 127 < 2^7.
INT8_PRECISION_BITS = 7
_DTYPES: dict[int, np.dtype[Any]] = {16: np.dtype("<u2"), 32: np.dtype("<u4")}
_SIGNED_NP: dict[int, np.dtype[Any]] = {16: np.dtype("<i2"), 32: np.dtype("<i4")}
_ENCODE_CHUNK = 1 << 20


def required_ring_bits(n_max: int, precision_bits: int) -> int:
    """The fewest ring bits b in which the sum of `n_max` contributions of |e| ≤ 2^p − 1 cannot wrap:
    ⌈log2 n_max⌉ + p + 1 (the + 1 is the sign)."""
    if n_max < 1:
        raise ConfigError(f"the number of participants must be at least 1, got {n_max}")
    if precision_bits < 1:
        raise ConfigError(f"precision must be at least 1 bit, got {precision_bits}")
    return math.ceil(math.log2(n_max)) + precision_bits + 1


def max_participants(bits: int, precision_bits: int) -> int:
    """The largest N that `required_ring_bits` admits in a 2^bits ring (0 if none)."""
    spare = bits - 1 - precision_bits
    return 2**spare if spare >= 0 else 0


def check_ring(bits: int, n_max: int, precision_bits: int) -> None:
    """Refuse (ConfigError, with the reason) a ring in which N contributions could wrap."""
    if bits not in RING_BITS:
        raise ConfigError(f"ring size must be one of 2^{', 2^'.join(map(str, RING_BITS))}, got 2^{bits}")
    need = required_ring_bits(n_max, precision_bits)
    if bits < need:
        raise ConfigError(
            f"a 2^{bits} ring cannot hold the sum of {n_max} contributions at {precision_bits} bits of precision "
            f"(needs b >= ceil(log2 N) + p + 1 = {need}; at most {max_participants(bits, precision_bits)} "
            f"participants fit): use a 2^32 ring or fewer bits of precision"
        )


@dataclass(frozen=True)
class FixedPoint:
    """The round's public encoding: ring size 2^bits, clip range [−clip, clip], precision bits p,
    and the most participants n_max whose sum it must hold. Checked on construction."""

    bits: int
    clip: float
    precision_bits: int
    n_max: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError(f"the clip range R must be a positive finite number, got {self.clip}")
        check_ring(self.bits, self.n_max, self.precision_bits)

    @classmethod
    def plan(
        cls, n_max: int, clip: float, min_precision_bits: int = INT8_PRECISION_BITS, bits: int | None = None
    ) -> FixedPoint:
        """The smallest ring (or `bits`) with at least `min_precision_bits` for `n_max`, every spare bit
        spent on precision. ConfigError if even 2^32 cannot hold it."""
        for b in (bits,) if bits is not None else RING_BITS:
            p = b - 1 - math.ceil(math.log2(max(n_max, 1)))
            if p >= min_precision_bits:
                return cls(b, clip, p, n_max)
        raise ConfigError(
            f"no ring holds {n_max} participants at {min_precision_bits} bits of precision "
            f"(needs 2^{required_ring_bits(n_max, min_precision_bits)})"
        )

    @property
    def dtype(self) -> np.dtype[Any]:
        return _DTYPES[self.bits]

    @property
    def scale(self) -> float:
        """Ring units per unit of value: a contribution of R encodes as 2^p − 1."""
        return float(2**self.precision_bits - 1) / self.clip

    @property
    def bytes_per_value(self) -> int:
        return self.bits // 8

    def encode(self, values: torch.Tensor, weight: float) -> np.ndarray:
        """`weight · clamp(values, −R, R)` in fixed point, as ring elements (flattened)."""
        if not (0.0 <= weight <= 1.0):
            raise ConfigError(f"a token weight is in [0, 1], got {weight}")
        if not values.is_floating_point():
            raise ConfigError(f"only floating tensors are aggregated securely, got {values.dtype}")
        # float32 holds every integer below 2^24 exactly and rounds the product by 2^-24 of it, far
        # under half a unit: enough up to 22 bits of precision; past that, float64. The work runs in
        # cache-sized chunks through one scratch buffer (never the caller's tensor, never a
        # model-sized temporary: at 100M parameters those cost more in page faults than the math).
        wide = torch.float32 if self.precision_bits <= 22 else torch.float64
        flat = values.detach().reshape(-1)
        out = np.empty(flat.numel(), dtype=_SIGNED_NP[self.bits])
        out_t = torch.from_numpy(out)
        scratch = torch.empty(min(flat.numel(), _ENCODE_CHUNK), dtype=wide)
        factor = weight * self.scale
        for off in range(0, flat.numel(), _ENCODE_CHUNK):
            n = min(_ENCODE_CHUNK, flat.numel() - off)
            v = scratch[:n]
            v.copy_(flat[off : off + n])
            # one sum, not isfinite(): NaN and ±Inf make it non-finite (so do values near float32's
            # limit, which no update should hold either); isfinite().all() costs 100× the math
            if not math.isfinite(float(v.sum())):
                raise ConfigError("an update to mask holds NaN, Inf or values past float32's range")
            # |v| <= R and w <= 1, so |v·w·s| <= 2^p − 1 up to a float rounding of 2^-24 of it, which
            # rounds back to at most 2^p − 1 (the worst-case test checks it): no second clamp
            v.clamp_(-self.clip, self.clip).mul_(factor).round_()
            out_t[off : off + n].copy_(v)
        # |e| <= 2^p − 1 < 2^(b−1): the signed b-bit integer is exact, and its bits read as unsigned
        # are e mod 2^b (two's complement)
        return out.view(self.dtype)

    def decode(self, ring_sum: np.ndarray, total_weight: float = 1.0) -> torch.Tensor:
        """The float32 values of a ring sum (centred: [−2^(b−1), 2^(b−1)) ), divided by the scale and by
        `total_weight` (the survivors' weights, so dropouts still give a mean)."""
        if ring_sum.dtype != self.dtype:
            raise ConfigError(f"a 2^{self.bits} ring sum is {self.dtype}, got {ring_sum.dtype}")
        if not total_weight > 0:
            raise ConfigError(f"the survivors' total weight must be positive, got {total_weight}")
        # the unsigned bits read as signed are the centred representative: [-2^(b-1), 2^(b-1))
        signed = torch.from_numpy(ring_sum.view(_SIGNED_NP[self.bits]))
        if self.bits == 16:  # int16 is exact in float32, and so is the division to 2^-24
            return signed.to(torch.float32).div_(self.scale * total_weight)
        return (signed.to(torch.float64) / (self.scale * total_weight)).to(torch.float32)

    def zeros(self, numel: int) -> np.ndarray:
        return np.zeros(numel, dtype=self.dtype)


def ring_add(acc: np.ndarray, value: np.ndarray) -> None:
    """acc += value mod 2^b, in place (unsigned numpy addition wraps by definition)."""
    np.add(acc, value, out=acc)


def ring_sub(acc: np.ndarray, value: np.ndarray) -> None:
    """acc −= value mod 2^b, in place."""
    np.subtract(acc, value, out=acc)
