"""The fixed-point ring: the no-wrap rule b >= ceil(log2 N) + p + 1, the ring each N gets, and
sums that read back exactly up to the declared bound and are refused past it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedtrain.errors import ConfigError
from fedtrain.privacy.ring import (
    INT8_PRECISION_BITS,
    FixedPoint,
    check_ring,
    max_participants,
    required_ring_bits,
    ring_add,
)


@pytest.mark.parametrize(
    "n, p, bits",
    [(1, 7, 8), (2, 7, 9), (8, 7, 11), (256, 7, 16), (257, 7, 17), (8, 12, 16), (1000, 20, 31)],
)
def test_required_ring_bits_is_the_written_rule(n: int, p: int, bits: int) -> None:
    assert required_ring_bits(n, p) == bits == math.ceil(math.log2(n)) + p + 1


def test_int8_updates_fit_a_16_bit_ring_up_to_256_participants() -> None:
    assert max_participants(16, INT8_PRECISION_BITS) == 256
    assert FixedPoint.plan(256, clip=1.0).bits == 16
    assert FixedPoint.plan(257, clip=1.0).bits == 32
    assert FixedPoint.plan(8, clip=1.0).bytes_per_value == 2


def test_plan_spends_the_spare_bits_on_precision() -> None:
    fp = FixedPoint.plan(8, clip=0.5)
    assert (fp.bits, fp.precision_bits) == (16, 12)
    assert required_ring_bits(8, fp.precision_bits) == 16
    assert FixedPoint.plan(300, clip=1.0).precision_bits == 31 - 9


@pytest.mark.parametrize("bits, n, p", [(16, 257, 7), (16, 9, 12), (32, 2**24 + 1, 7)])
def test_a_ring_too_small_for_n_is_refused(bits: int, n: int, p: int) -> None:
    with pytest.raises(ConfigError, match="cannot hold"):
        check_ring(bits, n, p)
    with pytest.raises(ConfigError):
        FixedPoint(bits, 1.0, p, n)


def test_no_ring_holds_too_many_participants() -> None:
    with pytest.raises(ConfigError, match="no ring"):
        FixedPoint.plan(2**25, clip=1.0)


@pytest.mark.parametrize(
    "fp",
    [
        FixedPoint(16, 1.0, 7, 256),
        FixedPoint(16, 0.1, 12, 8),
        FixedPoint(16, 2.0, 12, 8),
        FixedPoint(32, 1.0, 22, 300),
        FixedPoint(32, 0.3, 28, 8),
    ],
)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_worst_case_sum_at_the_bound_does_not_wrap(fp: FixedPoint, sign: float) -> None:
    """N contributions all at ±R with weight 1 (more than honest weights ever give) read back exactly."""
    values = torch.full((64,), sign * 10 * fp.clip)  # clamped to ±R
    acc = fp.zeros(64)
    for _ in range(fp.n_max):
        ring_add(acc, fp.encode(values, 1.0))
    got = fp.decode(acc).double()
    assert torch.allclose(got, torch.full((64,), sign * fp.clip * fp.n_max, dtype=torch.float64), rtol=1e-6)


def test_past_the_bound_a_sum_wraps() -> None:
    """What the rule protects against. It is conservative by under one contribution's worth
    (258 · 127 < 2^15 still fits); at 259 worst-case int8 contributions the sum flips its sign."""
    fp = FixedPoint(16, 1.0, 7, 256)
    acc = fp.zeros(4)
    for _ in range(259):
        ring_add(acc, fp.encode(torch.ones(4), 1.0))
    assert bool((fp.decode(acc) < 0).all())


def test_encode_decode_round_trip_within_half_a_unit() -> None:
    fp = FixedPoint.plan(4, clip=1.0)
    x = torch.linspace(-1, 1, 1001)
    got = fp.decode(fp.encode(x, 0.25), total_weight=0.25)
    assert float((got - x).abs().max()) <= 0.5 / fp.scale / 0.25 + 1e-7


def test_encode_clamps_to_the_range_and_checks_its_input() -> None:
    fp = FixedPoint.plan(2, clip=0.5)
    assert fp.decode(fp.encode(torch.tensor([3.0, -3.0]), 1.0)).tolist() == [0.5, -0.5]
    with pytest.raises(ConfigError, match="NaN"):
        fp.encode(torch.tensor([float("nan")]), 1.0)
    with pytest.raises(ConfigError, match="weight"):
        fp.encode(torch.zeros(2), 1.5)
    with pytest.raises(ConfigError, match="floating"):
        fp.encode(torch.zeros(2, dtype=torch.int32), 1.0)
    with pytest.raises(ConfigError):
        fp.decode(np.zeros(2, dtype=np.uint32))
    with pytest.raises(ConfigError):
        FixedPoint(16, float("inf"), 7, 2)
