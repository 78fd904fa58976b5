"""Compressed deltas: int8 per-block quantization error bounds, bf16, error feedback, specs."""

from __future__ import annotations

import pytest
import torch

from fedtrain.errors import WireError
from fedtrain.wire import EncodedBody, read_tensors
from fedtrain.wire.compress import (
    ErrorFeedback,
    compress,
    decompress,
    dequantize_int8,
    expected_specs,
    quantize_int8,
)


def test_int8_error_is_at_most_half_a_step_per_block() -> None:
    torch.manual_seed(0)
    t = torch.randn(1000) * torch.linspace(0.01, 10, 1000)  # blocks of very different magnitude
    q, scales = quantize_int8(t, block=64)
    assert q.dtype == torch.int8 and q.shape == t.shape and scales.shape == (16,)
    back = dequantize_int8(q, scales, block=64)
    err = (back - t).abs().view(-1)
    for b in range(16):
        blk = slice(b * 64, min((b + 1) * 64, 1000))
        assert float(err[blk].max()) <= float(scales[b]) / 2 + 1e-6
    # hand-checked: one block [0.5, -1.0, 0.25] -> scale 1/127, values 64 (63.5 rounds to even: 64), -127, 32
    q, s = quantize_int8(torch.tensor([0.5, -1.0, 0.25]), block=4)
    assert q.tolist() == [64, -127, 32] and torch.allclose(s, torch.tensor([1 / 127]))


def test_zero_block_and_shapes() -> None:
    t = torch.zeros(3, 5)
    q, s = quantize_int8(t, block=4)
    assert torch.equal(dequantize_int8(q, s, block=4), t)
    with pytest.raises(WireError, match="block scales"):
        dequantize_int8(q, torch.ones(2), block=4)
    with pytest.raises(WireError, match="finite"):
        dequantize_int8(q, torch.full((4,), float("nan")), block=4)


@pytest.mark.parametrize("scheme,ratio", [("none", 1.0), ("bf16", 0.5), ("int8", 0.26)])
def test_round_trip_through_a_body(scheme: str, ratio: float) -> None:
    torch.manual_seed(1)
    delta = {"w": torch.randn(64, 64), "b": torch.randn(64), "steps": torch.tensor([3], dtype=torch.int64)}
    tensors, meta = compress(delta, scheme)
    body = EncodedBody(tensors, meta)
    plain = EncodedBody(delta)
    assert body.content_length <= plain.content_length * ratio + 1024
    spec = {n: (t.dtype, tuple(t.shape)) for n, t in delta.items()}
    assert {n: (s.dtype, s.shape) for n, s in body.specs.items()} == expected_specs(spec, scheme)
    out = dict(decompress(read_tensors(body, expected_digest=body.digest()), meta))
    assert set(out) == set(delta) and out["w"].dtype == torch.float32
    tol = {"none": 0.0, "bf16": 0.02, "int8": 0.03}[scheme]
    assert (out["w"] - delta["w"]).abs().max() <= tol * delta["w"].abs().max()
    assert torch.equal(out["steps"], delta["steps"])


def test_error_feedback_keeps_the_sum_of_sent_updates_close() -> None:
    torch.manual_seed(2)
    ef = ErrorFeedback()
    true_sum = torch.zeros(512)
    sent_sum = torch.zeros(512)
    plain_sum = torch.zeros(512)
    for _ in range(20):
        d = torch.randn(512) * 1e-3 + 1e-4  # a small bias that plain int8 rounding keeps losing
        true_sum += d
        tensors, meta = ef.compress({"x": d}, "int8", block=512)
        sent_sum += dict(decompress(tensors.items(), meta))["x"]
        t2, m2 = compress({"x": d}, "int8", block=512)
        plain_sum += dict(decompress(t2.items(), m2))["x"]
    # with feedback the cumulative error is one round's quantization error, not twenty
    assert (sent_sum - true_sum).abs().max() < (plain_sum - true_sum).abs().max()
    assert torch.allclose(sent_sum + ef.residual["x"], true_sum, atol=1e-5)


def test_unknown_scheme_refused() -> None:
    with pytest.raises(WireError, match="unknown compression"):
        compress({"x": torch.ones(2)}, "zip")
    with pytest.raises(WireError, match="without their tensors"):
        list(decompress([("x::scale", torch.ones(1))], {"fedtrain.compression": "int8"}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite(dtype: torch.dtype) -> None:
    from fedtrain.coordinator.service import all_finite

    t = torch.randn(1000).to(dtype)
    assert all_finite(t) and all_finite(torch.zeros(0, dtype=dtype)) and all_finite(torch.arange(3))
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[517] = bad
        assert not all_finite(u), bad
