"""Deflated codes (`train.entropy_coding: deflate`): lossless against the plain block codecs,
fewer bytes on int2's skewed codes, a header within the bound, and every bad stream refused."""

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
