"""Mask streams and the pairing graph: one stream per (seed, kind, tensor), pairwise masks that
cancel, and a SecAgg+ graph that is k-regular, symmetric and the same for everyone."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import torch

from fedtrain.privacy.failures import PrivacyError
from fedtrain.privacy.masks import PAIR, SELF, apply_masks, mask_stream, mask_tensor, pairing_graph
from fedtrain.privacy.ring import FixedPoint, ring_add


@pytest.mark.parametrize("bits, dtype", [(16, np.uint16), (32, np.uint32)])
def test_a_stream_is_deterministic_and_sized(bits: int, dtype: type) -> None:
    seed = secrets.token_bytes(32)
    a = mask_stream(seed, PAIR, "w", 1001, bits)
    assert a.dtype == dtype and a.shape == (1001,)
    assert np.array_equal(a, mask_stream(seed, PAIR, "w", 1001, bits))
    # a longer stream starts with the shorter one: the stream crosses chunk boundaries cleanly
    assert np.array_equal(mask_stream(seed, PAIR, "w", 3 << 20, bits)[:1001], a)


@pytest.mark.parametrize("bits", [16, 32])
def test_a_stream_started_at_a_block_is_the_tail_of_the_whole_stream(bits: int) -> None:
    seed = secrets.token_bytes(32)
    whole = mask_stream(seed, SELF, "w", 10_000, bits)
    start = 64 // (bits // 8) * 37
    assert np.array_equal(mask_stream(seed, SELF, "w", 10_000 - start, bits, start=start), whole[start:])
    with pytest.raises(PrivacyError, match="block"):
        mask_stream(seed, SELF, "w", 10, bits, start=3)


@pytest.mark.parametrize("bits", [16, 32])
def test_masks_drawn_in_threads_equal_masks_drawn_in_one(bits: int) -> None:
    """Block-aligned ranges in threads give the same array as one pass (sizes not multiples of a block)."""
    size = 3 * (1 << 20) + 1234
    terms = [(secrets.token_bytes(32), kind, sign) for kind, sign in ((SELF, 1), (PAIR, -1), (PAIR, 1))]
    dtype = np.uint16 if bits == 16 else np.uint32
    one = apply_masks(np.arange(size, dtype=dtype), terms, "t", bits, workers=1)
    for workers in (2, 3, 5):
        assert np.array_equal(apply_masks(np.arange(size, dtype=dtype), terms, "t", bits, workers=workers), one)


def test_streams_differ_by_seed_kind_and_tensor() -> None:
    seed = secrets.token_bytes(32)
    base = mask_stream(seed, PAIR, "layer.0", 4096, 16)
    for other in (
        mask_stream(seed, PAIR, "layer.1", 4096, 16),
        mask_stream(seed, SELF, "layer.0", 4096, 16),
        mask_stream(secrets.token_bytes(32), PAIR, "layer.0", 4096, 16),
    ):
        assert np.mean(base == other) < 0.01


def test_stream_inputs_are_checked() -> None:
    with pytest.raises(PrivacyError):
        mask_stream(b"short", PAIR, "x", 4, 16)
    with pytest.raises(PrivacyError):
        mask_stream(bytes(32), PAIR, "x", 4, 8)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_pairwise_masks_cancel_and_self_masks_do_not(n: int) -> None:
    fp = FixedPoint.plan(n, clip=1.0)
    ids = list(range(1, n + 1))
    seeds = {frozenset((u, v)): secrets.token_bytes(32) for u in ids for v in ids if u < v}
    zero = secrets.token_bytes(32)
    acc = fp.zeros(512)
    for u in ids:
        pairs = {v: seeds[frozenset((u, v))] for v in ids if v != u}
        ring_add(acc, mask_tensor(fp.encode(torch.zeros(512), 1.0), "t", u, zero, pairs, fp))
    # every pairwise mask cancelled; what is left is n copies of the (here shared) self mask
    expected = fp.zeros(512)
    for _ in ids:
        ring_add(expected, mask_stream(zero, SELF, "t", 512, fp.bits))
    assert np.array_equal(acc, expected)


@pytest.mark.parametrize("n, k", [(10, 4), (11, 4), (20, 6), (9, 3), (30, 8)])
def test_the_sparse_graph_is_regular_symmetric_and_public(n: int, k: int) -> None:
    ids = [3 * i + 1 for i in range(n)]
    seed = secrets.token_bytes(16)
    g = pairing_graph(ids, k, seed)
    assert g == pairing_graph(list(reversed(ids)), k, seed)  # everyone derives the same graph
    k_even = k + k % 2
    for u, vs in g.items():
        assert len(vs) == k_even and u not in vs
        assert all(u in g[v] for v in vs)
    assert g != pairing_graph(ids, k, secrets.token_bytes(16))
    # connected: a breadth-first walk from one node reaches all
    seen, todo = {ids[0]}, [ids[0]]
    while todo:
        for v in g[todo.pop()] - seen:
            seen.add(v)
            todo.append(v)
    assert seen == set(ids)


def test_small_rounds_and_large_degrees_pair_everyone() -> None:
    assert pairing_graph([1, 2, 3, 4], None, b"") == {u: frozenset({1, 2, 3, 4} - {u}) for u in (1, 2, 3, 4)}
    assert pairing_graph([1, 2, 3, 4], 3, b"") == pairing_graph([1, 2, 3, 4], None, b"")
    with pytest.raises(PrivacyError):
        pairing_graph([1, 2, 3, 4, 5, 6], 1, bytes(16))
    with pytest.raises(PrivacyError, match="seed"):
        pairing_graph(range(1, 20), 4, b"short")
