"""The block codecs' options. Deflated codes (`train.entropy_coding: deflate`): lossless against
the plain codecs, fewer bytes on int2's skewed codes, a header within the bound, every bad
stream refused. bf16 scales (`train.compression_scale: bf16`): the codes made against the
rounded scale, against a naive reference."""

from __future__ import annotations

import zlib

import pytest
import torch

from fedtrain.errors import WireError
from fedtrain.wire import EncodedBody, read_tensors
from fedtrain.wire.compress import (
    BLOCK_SCHEMES,
    Codec,
    compress,
    decompress,
    deflate_bound,
    expected_specs,
    fit_specs,
    inflate,
)
from fedtrain.wire.delta import download_codec


def _delta(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 50, generator=g) * torch.linspace(0.01, 3, 50), "b": torch.randn(7, generator=g),
            "e": torch.zeros(0), "z": torch.zeros(300), "steps": torch.tensor([3], dtype=torch.int64)}


def _shapes(d: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in d.items()}


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_deflated_codes_decode_to_the_same_values_and_fit_the_header(scheme: str) -> None:
    delta, plain_codec, codec = _delta(), Codec(scheme, 64), Codec(scheme, 64, deflate=True)
    plain, pmeta = compress(delta, plain_codec)
    tensors, meta = compress(delta, codec)
    assert Codec.of(meta) == codec and meta["fedtrain.entropy"] == "deflate"
    body = EncodedBody(tensors, meta)
    spec = {n: (t.dtype, tuple(t.shape)) for n, t in delta.items()}
    want = expected_specs(spec, codec)
    got = {n: (s.dtype, s.shape) for n, s in body.specs.items()}
    assert got != want and fit_specs(want, got, codec) == want  # lengths vary, within the bound
    out = dict(decompress(read_tensors(body, expected_digest=body.digest()), meta, shapes=_shapes(delta)))
    ref = dict(decompress(plain.items(), pmeta, shapes=_shapes(delta)))
    assert set(out) == set(ref) and all(torch.equal(out[n], ref[n]) for n in ref)


def test_int2_codes_deflate_to_fewer_bytes() -> None:
    g = torch.Generator().manual_seed(1)
    delta = {"w": torch.randn(100_000, generator=g)}  # most int2 codes are the inner two levels
    plain, _ = compress(delta, Codec("int2"))
    tensors, _ = compress(delta, Codec("int2", deflate=True))
    assert tensors["w"].numel() < 0.75 * plain["w"].numel()


def test_a_codes_length_past_the_bound_does_not_fit() -> None:
    codec = Codec("int2", 64, deflate=True)
    want = expected_specs({"w": (torch.float32, (1000,))}, codec)
    bound = want["w"][1][0]
    assert bound == deflate_bound(250)
    for bad in ((bound + 1,), (0,), (2, bound // 2)):
        assert fit_specs(want, {**want, "w": (torch.uint8, bad)}, codec)["w"] != want["w"]
    assert fit_specs(want, {**want, "w::scale": (torch.float32, (3,))}, codec)["w::scale"] == (torch.float32, (3,))


def _u8(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


@pytest.mark.parametrize("stream, words", [
    (zlib.compress(bytes(1_000_000)), "exactly 100 bytes"),  # a bomb: stops at 100 bytes
    (zlib.compress(bytes(99)), "exactly 100 bytes"),  # short
    (zlib.compress(bytes(100)) + b"\x00", "exactly 100 bytes"),  # something after the stream
    (zlib.compress(bytes(100))[:-3], "exactly 100 bytes"),  # cut short
    (b"not a zlib stream", "not a zlib stream"),
])
def test_inflate_refuses_every_stream_but_one_of_exactly_n_bytes(stream: bytes, words: str) -> None:
    assert torch.equal(inflate(_u8(zlib.compress(bytes(range(100)))), 100, "w"), torch.arange(100, dtype=torch.uint8))
    with pytest.raises(WireError, match=words):
        inflate(_u8(stream), 100, "w")


def test_an_empty_tensor_inflates_to_nothing_and_no_more() -> None:
    assert inflate(_u8(zlib.compress(b"")), 0, "e").numel() == 0
    with pytest.raises(WireError, match="exactly 0 bytes"):
        inflate(_u8(zlib.compress(bytes(10_000))), 0, "e")  # max_length 0 would mean no limit


def test_metadata_and_config_name_deflate_for_block_codecs_only() -> None:
    from fedtrain.config import TrainConfig

    with pytest.raises(WireError, match="block codecs"):
        Codec("topk", deflate=True)
    with pytest.raises(WireError, match="block codecs"):
        Codec.of({"fedtrain.compression": "topk", "fedtrain.topk": "3", "fedtrain.chunk": "64",
                  "fedtrain.bits": "2", "fedtrain.entropy": "deflate"})
    with pytest.raises(WireError, match="block codecs"):
        Codec.of({"fedtrain.compression": "int8", "fedtrain.entropy": "deflate"})
    with pytest.raises(WireError, match="fedtrain.entropy"):
        Codec.of({"fedtrain.compression": "int2", "fedtrain.entropy": "brotli"})
    train = TrainConfig(compression="int2", download_compression="int2", entropy_coding="deflate")
    assert Codec.for_train(train).deflate and download_codec(train).deflate  # type: ignore[union-attr]
    mixed = TrainConfig(compression="topk", download_compression="int2", entropy_coding="deflate")
    assert not Codec.for_train(mixed).deflate and download_codec(mixed).deflate  # type: ignore[union-attr]


def naive_int2_bf16(t: torch.Tensor, block: int) -> torch.Tensor:
    """int2 with its block's absmax rounded to bf16 first: each value to the nearest of -1, -1/3,
    1/3, 1 times that scale (a value past it to the nearest end)."""
    flat = t.reshape(-1).tolist()
    out = []
    for b in range(0, len(flat), block):
        blk = flat[b : b + block]
        s = float(torch.tensor(max(abs(v) for v in blk)).to(torch.bfloat16))
        levels = [-1.0, -1.0 / 3, 1.0 / 3, 1.0]
        out += [min(levels, key=lambda lv: (abs(lv - v / s), -lv)) * s if s else 0.0 for v in blk]
    return torch.tensor(out).reshape(t.shape)


@pytest.mark.parametrize("deflate", [False, True])
def test_bf16_scales_halve_the_scales_and_match_the_naive_reference(deflate: bool) -> None:
    delta = _delta(3)
    codec = Codec("int2", 64, deflate=deflate, bf16_scales=True)
    tensors, meta = compress(delta, codec)
    assert Codec.of(meta) == codec and meta["fedtrain.scale"] == "bf16"
    if not deflate:  # (deflated, the scales travel as a zlib stream of their bytes)
        assert tensors["w::scale"].dtype == torch.bfloat16 and tensors["w::scale"].numel() == 2000 // 64 + 1
    spec = {n: (t.dtype, tuple(t.shape)) for n, t in delta.items()}
    want = expected_specs(spec, codec)
    assert want["w::scale"] == ((torch.uint8, (deflate_bound(64),)) if deflate else (torch.bfloat16, (32,)))
    body = EncodedBody(tensors, meta)
    assert fit_specs(want, {n: (s.dtype, s.shape) for n, s in body.specs.items()}, codec) == want
    out = dict(decompress(read_tensors(body, expected_digest=body.digest()), meta, shapes=_shapes(delta)))
    for name in ("w", "b", "z", "e"):
        torch.testing.assert_close(out[name], naive_int2_bf16(delta[name], 64), rtol=1e-6, atol=1e-7)
    # A block whose absmax (1 + 3/512) rounds up in bf16 (to 1 + 1/128), and a value between 2/3 of
    # each: against the sent scale it is nearer 1/3 of it, against the fp32 absmax nearer 1.
    x = torch.tensor([1.0 + 3 / 512, 0.671])
    t2, m2 = compress({"x": x}, Codec("int2", 2, deflate=deflate, bf16_scales=True))
    got = dict(decompress(t2.items(), m2, shapes={"x": (2,)}))["x"]
    assert got.tolist() == [1.0078125, 1.0078125 / 3] == naive_int2_bf16(x, 2).tolist()


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_bf16_scales_decode_to_what_the_codes_were_made_against(scheme: str) -> None:
    """Every block codec with bf16 scales: the values decoded are the codes times the scales
    sent, so the sender's error feedback (which decodes the body) keeps exactly what was lost."""
    from fedtrain.wire.compress import ErrorFeedback

    delta = _delta(4)
    fb = ErrorFeedback()
    tensors, meta = fb.compress(delta, Codec(scheme, 64, bf16_scales=True))
    sent = dict(decompress(tensors.items(), meta, shapes=_shapes(delta)))
    for name in ("w", "b"):
        assert torch.equal(fb.residual[name], delta[name] - sent[name])
        assert float((sent[name] - delta[name]).norm()) < float(delta[name].norm())


def test_metadata_and_config_name_bf16_scales_for_block_codecs_only() -> None:
    from fedtrain.config import TrainConfig

    with pytest.raises(WireError, match="block codecs"):
        Codec("int8", bf16_scales=True)
    with pytest.raises(WireError, match="fedtrain.scale"):
        Codec.of({"fedtrain.compression": "int2", "fedtrain.scale": "fp8"})
    with pytest.raises(WireError, match="block codecs"):
        Codec.of({"fedtrain.compression": "topk", "fedtrain.topk": "3", "fedtrain.chunk": "64",
                  "fedtrain.bits": "2", "fedtrain.scale": "bf16"})
    train = TrainConfig(compression="e3m0", download_compression="int8", compression_scale="bf16")
    assert Codec.for_train(train).bf16_scales and not download_codec(train).bf16_scales  # type: ignore[union-attr]
