"""A single masked upload looks uniform over the ring — its values, the difference of two of its
tensors (a mask reused across tensors would leave x_a − x_b there) and the difference of one
tensor between two rounds (a mask reused across rounds would leave x − x' there) — and the same
test rejects an unmasked upload and both kinds of reuse (the negative controls below), so it can fail.

Each check is a chi-square over the top and the bottom 8 bits and a Kolmogorov–Smirnov test,
at α = 1e-6: a correct implementation fails one by chance about once in a hundred thousand runs.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import torch
from scipy import stats

from fedtrain.privacy import FixedPoint, RoundSetup, RoundTag, SecAggParticipant
from fedtrain.privacy.masks import SELF, mask_stream
from fedtrain.privacy.ring import ring_add, ring_sub

ALPHA = 1e-6
NUMEL = 1 << 16


def looks_uniform(values: np.ndarray, bits: int) -> bool:
    v = values.astype(np.uint64)
    top = np.bincount((v >> np.uint64(bits - 8)).astype(np.int64), minlength=256)
    low = np.bincount((v & np.uint64(0xFF)).astype(np.int64), minlength=256)
    p_values = [
        stats.chisquare(top).pvalue,
        stats.chisquare(low).pvalue,
        stats.kstest(v.astype(np.float64) / 2.0**bits, "uniform").pvalue,
    ]
    return min(p_values) > ALPHA


def _update(seed: int) -> dict[str, torch.Tensor]:
    """Small, far from uniform values: an unmasked encoding sits in a narrow band around 0."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(NUMEL, generator=g) * 0.01, "b": torch.randn(NUMEL, generator=g) * 0.01}


def _masked_upload(
    bits: int, round_: int, update: dict[str, torch.Tensor], ahead: bool = False
) -> dict[str, np.ndarray]:
    """Participant 1's upload in a real three-participant round (keys and shares exchanged)."""
    fp = FixedPoint.plan(3, clip=1.0, bits=bits)
    setup = RoundSetup(RoundTag("run", round_), fp, 2, None, secrets.token_bytes(16))
    parts = {u: SecAggParticipant(u, setup) for u in (1, 2, 3)}
    directory = {u: p.advertise() for u, p in parts.items()}
    mail: dict[int, dict[int, bytes]] = {u: {} for u in parts}
    for u, p in parts.items():
        for v, blob in p.share(directory).items():
            mail[v][u] = blob
    parts[1].receive(mail[1])
    if ahead:
        parts[1].precompute({n: t.numel() for n, t in update.items()}, {1, 2, 3})
    return parts[1].mask(update, 1 / 3, {1, 2, 3})


def _diff(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    out = x.copy()
    ring_sub(out, y)
    return out


@pytest.mark.parametrize("bits, ahead", [(16, False), (32, False), (16, True)])
def test_a_masked_upload_is_uniform_within_and_across_tensors_and_rounds(bits: int, ahead: bool) -> None:
    update = _update(0)
    first = _masked_upload(bits, 1, update, ahead)
    second = _masked_upload(bits, 2, update, ahead)
    assert looks_uniform(first["a"], bits)
    assert looks_uniform(first["b"], bits)
    assert looks_uniform(_diff(first["a"], first["b"]), bits)  # no mask shared between tensors
    assert looks_uniform(_diff(first["a"], second["a"]), bits)  # no mask shared between rounds


@pytest.mark.parametrize("bits", [16, 32])
def test_negative_control_an_unmasked_upload_fails(bits: int) -> None:
    fp = FixedPoint.plan(3, clip=1.0, bits=bits)
    assert not looks_uniform(fp.encode(_update(0)["a"], 1 / 3), bits)


@pytest.mark.parametrize("bits", [16, 32])
def test_negative_control_a_mask_reused_across_tensors_fails(bits: int) -> None:
    fp = FixedPoint.plan(3, clip=1.0, bits=bits)
    update, seed = _update(1), secrets.token_bytes(32)
    masked = {}
    for name in ("a", "b"):
        e = fp.encode(update[name], 1 / 3)
        ring_add(e, mask_stream(seed, SELF, "same-label", NUMEL, bits))  # the bug: one label for all
        masked[name] = e
    assert looks_uniform(masked["a"], bits)  # each tensor alone still looks fine ...
    assert not looks_uniform(_diff(masked["a"], masked["b"]), bits)  # ... their difference gives it away


@pytest.mark.parametrize("bits", [16, 32])
def test_negative_control_a_mask_reused_across_rounds_fails(bits: int) -> None:
    fp = FixedPoint.plan(3, clip=1.0, bits=bits)
    seed = secrets.token_bytes(32)  # the bug: the same seed in two rounds
    rounds = []
    for r in (1, 2):
        e = fp.encode(_update(10 + r)["a"], 1 / 3)
        ring_add(e, mask_stream(seed, SELF, "a", NUMEL, bits))
        rounds.append(e)
    assert looks_uniform(rounds[0], bits)
    assert not looks_uniform(_diff(rounds[0], rounds[1]), bits)
