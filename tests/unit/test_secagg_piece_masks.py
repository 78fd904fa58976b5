"""Masks of a piece (an FSDP rank's rows of a tensor, flat): a row range's masks are exactly the
slice of the whole tensor's masks, at any element offset (block-aligned or not, drawn in one pass
or in threads), so pieces masked on separate ranks add up to the upload masked whole."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import torch

from fedtrain.privacy.failures import PrivacyError
from fedtrain.privacy.masks import PAIR, SELF, Term, apply_masks, mask_tensor
from fedtrain.privacy.participant_round import GroupMasks
from fedtrain.privacy.ring import FixedPoint, ring_add

TERMS: list[Term] = [(secrets.token_bytes(32), SELF, 1), (secrets.token_bytes(32), PAIR, -1),
                     (secrets.token_bytes(32), PAIR, 1)]


def whole_mask(size: int, bits: int) -> np.ndarray:
    dtype = np.uint16 if bits == 16 else np.uint32
    return apply_masks(np.zeros(size, dtype=dtype), TERMS, "blocks.0.w", bits)


@pytest.mark.parametrize("bits", [16, 32])
@pytest.mark.parametrize("lo, hi", [(0, 100), (32, 96), (1, 2), (7, 1000), (31, 33), (15, 17), (999, 1000),
                                    (5, 5), (100, 4000)])
def test_a_range_of_the_tensor_has_the_slice_of_its_masks(bits: int, lo: int, hi: int) -> None:
    dtype = np.uint16 if bits == 16 else np.uint32
    whole = whole_mask(4000, bits)
    piece = apply_masks(np.zeros(hi - lo, dtype=dtype), TERMS, "blocks.0.w", bits, offset=lo)
    assert np.array_equal(piece, whole[lo:hi])


@pytest.mark.parametrize("bits", [16, 32])
def test_an_unaligned_range_drawn_in_threads_equals_one_pass(bits: int) -> None:
    """Past the size where threads draw it, the cut points fall on blocks of the tensor, not of the piece."""
    dtype = np.uint16 if bits == 16 else np.uint32
    size, lo = 3 * (1 << 20) + 77, 12_345  # (not a multiple of a block for either ring)
    one = apply_masks(np.zeros(size, dtype=dtype), TERMS, "w", bits, offset=lo)
    threaded = apply_masks(np.zeros(size, dtype=dtype), TERMS, "w", bits, workers=4, offset=lo)
    assert np.array_equal(one, threaded)
    head = apply_masks(np.zeros(1000, dtype=dtype), TERMS, "w", bits, offset=lo)
    assert np.array_equal(one[:1000], head)


def test_a_negative_offset_is_refused() -> None:
    with pytest.raises(PrivacyError, match="element 0"):
        apply_masks(np.zeros(4, dtype=np.uint16), TERMS, "w", 16, offset=-1)


def test_pieces_masked_apart_make_the_whole_masked_tensor() -> None:
    """Two ranks' rows (split as torch.chunk splits rows), each masked at its offset, side by side
    are the tensor masked whole: the same upload, byte for byte."""
    fp = FixedPoint.plan(4, 0.5)
    group = GroupMasks(3, fp, secrets.token_bytes(32), {1: secrets.token_bytes(32), 5: secrets.token_bytes(32)})
    values = (torch.rand(7, 13) - 0.5) * 0.8  # 91 elements: the second rank starts at 52, off a block
    whole = mask_tensor(fp.encode(values, 0.25), "w", 3, group.self_seed, group.pair_seeds, fp)
    rows = [values[:4], values[4:]]
    pieces = [group.mask_rows("w", rows[0], 0.25, 0), group.mask_rows("w", rows[1], 0.25, 4 * 13)]
    assert np.array_equal(np.concatenate(pieces), whole)


def test_group_masks_travel_as_json_and_refuse_short_seeds() -> None:
    fp = FixedPoint.plan(8, 1.0, bits=32)
    group = GroupMasks(2, fp, secrets.token_bytes(32), {1: secrets.token_bytes(32)})
    assert GroupMasks.from_json(group.to_json()) == group
    bad = group.to_json()
    bad["pairs"] = {"1": "00" * 16}
    with pytest.raises(PrivacyError, match="32 bytes"):
        GroupMasks.from_json(bad)


def test_sums_of_pieces_cancel_like_whole_uploads() -> None:
    """u's pieces and v's whole upload: the pairwise masks cancel in the sum, leaving self masks."""
    fp = FixedPoint.plan(4, 0.5)
    pair = secrets.token_bytes(32)
    u = GroupMasks(1, fp, secrets.token_bytes(32), {2: pair})
    v = GroupMasks(2, fp, secrets.token_bytes(32), {1: pair})
    x = torch.full((100,), 0.1)
    acc = np.concatenate([u.mask_rows("t", x[:33], 1.0, 0), u.mask_rows("t", x[33:], 1.0, 33)])
    ring_add(acc, v.mask_rows("t", x, 1.0, 0))
    selves = apply_masks(fp.zeros(100), [(u.self_seed, SELF, 1), (v.self_seed, SELF, 1)], "t", fp.bits)
    np.subtract(acc, selves, out=acc)
    assert np.array_equal(acc, fp.encode(x, 1.0) + fp.encode(x, 1.0))
