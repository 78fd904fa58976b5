"""Sparse (topk) and e3m0 bodies from a hostile participant, through the real upload route: an
offset outside its chunk, a duplicate offset, a scale that is not finite, the wrong number of
chunks, metadata that lies about the body, parts out of order, padding bits set. Each is a
4xx that changes nothing, whether the sum is empty or already holds an update; an honest
body is then folded as its decoded values."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.wire import DIGEST_HEADER, EncodedBody
from fedtrain.wire.compress import Codec, compress, decompress
from tests.helpers.api import assert_error, assert_unchanged, client, snapshot

CODEC = Codec("topk", k=3, chunk=64, bits=2)
Body = tuple[dict[str, torch.Tensor], dict[str, str]]


def _delta(c: BackgroundCoordinator, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) * 1e-2 for n, t in c.service.inspect().weights.items()}


def _send(http, pid: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]):
    enc = EncodedBody(tensors, meta)
    return http.put(f"/v1/rounds/0/updates/{pid}", params={"tokens": 10}, content=b"".join(bytes(x) for x in enc),
                    headers={DIGEST_HEADER: enc.digest()})


def _largest(tensors: dict[str, torch.Tensor]) -> str:
    """The name of the body's largest topk tensor (several chunks)."""
    return max((n for n in tensors if n + "::idx" in tensors), key=lambda n: tensors[n + "::scale"].shape[0])


def _offset_out_of_range(t: dict, m: dict) -> Body:
    n = _largest(t)
    t[n + "::idx"][1] = 64  # chunk 0 holds offsets 0..63
    return t, m


def _duplicate_offset(t: dict, m: dict) -> Body:
    n = _largest(t)
    t[n + "::idx"][4] = t[n + "::idx"][3]
    return t, m


def _scale(value: float) -> Callable[[dict, dict], Body]:
    def bad(t: dict, m: dict) -> Body:
        t[_largest(t) + "::scale"][2, 1] = value
        return t, m
    return bad


def _wrong_chunk_count(t: dict, m: dict) -> Body:
    n = _largest(t)
    t[n + "::scale"] = t[n + "::scale"][:-1].clone()
    return t, m


def _metadata(**changes: str) -> Callable[[dict, dict], Body]:
    def lie(t: dict, m: dict) -> Body:
        return t, {**m, **changes}
    return lie


def _codes_before_scales(t: dict, m: dict) -> Body:
    n = _largest(t)
    reordered = {k: v for k, v in t.items() if k != n}
    return {n: t[n], **reordered}, m


def _padding_bits(t: dict, m: dict) -> Body:
    n = next(n for n in t if n + "::idx" in t and t[n + "::idx"].numel() % 4)
    t[n][-1] |= 0xC0
    return t, m


CASES = {
    "offset_out_of_range": (_offset_out_of_range, 400, "outside"),
    "duplicate_offset": (_duplicate_offset, 400, "strictly increasing"),
    "nan_scale": (_scale(float("nan")), 400, "finite"),
    "inf_scale": (_scale(float("inf")), 400, "finite"),
    "negative_scale": (_scale(-1.0), 400, "non-negative"),
    "wrong_chunk_count": (_wrong_chunk_count, 422, "shape of"),
    "metadata_k": (_metadata(**{"fedtrain.topk": "4"}), 422, "shape of"),
    "metadata_bits": (_metadata(**{"fedtrain.bits": "4"}), 422, "shape of"),
    "metadata_chunk": (_metadata(**{"fedtrain.chunk": "128"}), 422, "shape of"),
    "metadata_bad_bits": (_metadata(**{"fedtrain.bits": "3"}), 400, "bits"),
    "metadata_too_dense": (_metadata(**{"fedtrain.topk": "17"}), 400, "a quarter of the chunk"),
    "metadata_missing": (_metadata(**{"fedtrain.topk": ""}), 400, "fedtrain.topk"),
    "metadata_says_int8": (_metadata(**{"fedtrain.compression": "int8"}), 422, "expected"),
    "codes_before_scales": (_codes_before_scales, 400, "before its scales"),
    "padding_bits": (_padding_bits, 400, "padding"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_sparse_body_is_refused_and_changes_nothing(coord: BackgroundCoordinator, case: str) -> None:
    corrupt, status, words = CASES[case]
    with client(coord) as http:
        for holds_one in (False, True):  # the empty sum (first update), then a sum that holds one
            if holds_one:
                tensors, meta = compress(_delta(coord, 1), CODEC)
                assert _send(http, "a", tensors, meta).status_code == 200
            before = snapshot(coord)
            tensors, meta = compress(_delta(coord, 2), CODEC)
            tensors, meta = corrupt({k: v.clone() for k, v in tensors.items()}, meta)
            err = assert_error(_send(http, "b", tensors, meta), status)
            assert words in err["message"], err
            assert_unchanged(coord, before)


def test_an_honest_sparse_body_is_folded_as_its_decoded_values(coord: BackgroundCoordinator) -> None:
    weights = coord.service.inspect().weights
    shapes = {n: tuple(t.shape) for n, t in weights.items()}
    with client(coord) as http:
        tensors, meta = compress(_delta(coord, 3), CODEC)
        assert _send(http, "a", tensors, meta).status_code == 200
        inside = coord.service.inspect()
        assert inside.sum_count == 1
        for name, t in decompress(tensors.items(), meta, shapes=shapes):
            assert torch.equal(inside.sum_values[name], t), name


@pytest.mark.parametrize("scheme, bf16", [("e3m0", False), ("int2", False), ("int1", False), ("ternary", False),
                                         ("int2", True)])
def test_a_block_coded_body_with_a_bad_scale_or_size_is_refused(coord: BackgroundCoordinator, scheme: str,
                                                                 bf16: bool) -> None:
    with client(coord) as http:
        before = snapshot(coord)
        codec = Codec(scheme, block=64, bf16_scales=bf16)
        tensors, meta = compress(_delta(coord, 4), codec)
        name = next(n for n in tensors if n.endswith("::scale"))
        tensors[name][0] = float("nan")
        assert "finite" in assert_error(_send(http, "a", tensors, meta), 400)["message"]
        if bf16:  # fp32 scales in a body whose metadata says bf16: refused by the header
            tensors, meta = compress(_delta(coord, 4), Codec(scheme, block=64))
            assert "dtype" in assert_error(_send(http, "a", tensors, {**meta, "fedtrain.scale": "bf16"}),
                                           422)["message"]
        tensors, meta = compress(_delta(coord, 4), codec)
        tensors = {k: (v[:-1].clone() if k + "::scale" in tensors else v) for k, v in tensors.items()}
        assert_error(_send(http, "a", tensors, meta), 422)
        assert_unchanged(coord, before)


def test_a_ternary_byte_past_five_base_3_codes_is_refused(coord: BackgroundCoordinator) -> None:
    with client(coord) as http:
        before = snapshot(coord)
        tensors, meta = compress(_delta(coord, 5), Codec("ternary", block=64))
        name = next(n for n in tensors if n + "::scale" in tensors)
        tensors[name][0] = 250  # 3^5 = 243 values a byte: 250 names no five codes
        assert "over 242" in assert_error(_send(http, "a", tensors, meta), 400)["message"]
        assert_unchanged(coord, before)


def _deflated(coord: BackgroundCoordinator, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, str], str, int]:
    """A deflated int2 body (bf16 scales), its largest tensor and that tensor's codes' bytes."""
    delta = _delta(coord, seed)
    tensors, meta = compress(delta, Codec("int2", block=64, deflate=True, bf16_scales=True))
    name = max(delta, key=lambda n: delta[n].numel())
    return tensors, meta, name, -(-delta[name].numel() // 4)


def test_deflated_codes_that_lie_are_refused_and_change_nothing(coord: BackgroundCoordinator) -> None:
    """Deflated codes or scales: a zlib bomb (inflates past the tensor's bytes), a stream with
    bytes after it, one cut short, bytes that are no zlib stream, a NaN scale inside the
    stream: 400; codes longer than zlib's bound for the tensor: 422 from the header, before any
    byte is read. An honest deflated body is then folded as its decoded values."""
    import zlib

    with client(coord) as http:
        before = snapshot(coord)
        tensors, meta, name, need = _deflated(coord, 6)
        bodies = {
            "bomb": zlib.compress(bytes(need * 1000), 9),
            "trailing": bytes(tensors[name].numpy()) + b"\x00",
            "short": bytes(tensors[name].numpy())[:-2],
            "garbage": b"fedtrain" * 4,
        }
        for part in ("", "::scale"):
            for case, raw in bodies.items():
                if part:  # the same lies in the scales' stream (a bomb within the scales' bound)
                    raw = {"bomb": zlib.compress(bytes(need * 100), 9), "garbage": raw,
                           "trailing": bytes(tensors[name + part].numpy()) + b"\x00"}.get(
                        case, bytes(tensors[name + part].numpy())[:-2])
                bad = {**tensors, name + part: torch.frombuffer(bytearray(raw), dtype=torch.uint8)}
                err = assert_error(_send(http, "a", bad, meta), 400)
                assert name + part in err["message"], (case, part, err)
        n_scales = -(-need * 4 // 64)
        nan = torch.full((n_scales,), float("nan"), dtype=torch.bfloat16).view(torch.uint8)
        bad = {**tensors, name + "::scale": torch.frombuffer(bytearray(zlib.compress(bytes(nan.numpy()))),
                                                             dtype=torch.uint8)}
        assert "finite" in assert_error(_send(http, "a", bad, meta), 400)["message"]
        too_long = {**tensors, name: torch.zeros(need + need // 100 + 64, dtype=torch.uint8)}
        assert "shape of" in assert_error(_send(http, "a", too_long, meta), 422)["message"]
        assert_unchanged(coord, before)
        tensors, meta, _, _ = _deflated(coord, 7)
        assert _send(http, "a", tensors, meta).status_code == 200
        weights = coord.service.inspect().weights
        inside = coord.service.inspect()
        for n, t in decompress(tensors.items(), meta, shapes={n: tuple(w.shape) for n, w in weights.items()}):
            assert torch.equal(inside.sum_values[n], t), n
