"""e3m0 and topk compression against naive pure-torch references, error feedback over rounds,
the checks of every decoded part, and a topk update folded into the running sum sparse."""

from __future__ import annotations

import math

import pytest
import torch

from fedtrain.errors import MergeError, WireError
from fedtrain.merge import RunningSum
from fedtrain.wire import EncodedBody, read_tensors
from fedtrain.wire.compress import Codec, ErrorFeedback, compress, decode_parts, decompress, expected_specs
from fedtrain.wire.sparse import pack, pack_base3, topk_decode, unpack, unpack_base3

CODECS = [Codec("e3m0", block=64), Codec("topk", k=3, chunk=64, bits=2), Codec("topk", k=5, chunk=100, bits=4),
          Codec("topk", k=1, chunk=64, bits=2), Codec("int2", block=64), Codec("int1", block=64),
          Codec("ternary", block=64)]


def naive_e3m0(t: torch.Tensor, block: int) -> torch.Tensor:
    """Each value to the nearest of 0, ±2^-6..±2^0 times its block's absmax, one at a time."""
    flat = t.reshape(-1).tolist()
    out = []
    for b in range(0, len(flat), block):
        blk = flat[b : b + block]
        s = max(abs(v) for v in blk)
        levels = [0.0] + [2.0 ** (m - 7) for m in range(1, 8)]
        for v in blk:
            a = abs(v) / s if s else 0.0
            best = min(levels, key=lambda lv: (abs(lv - a), -lv))  # a tie goes up
            out.append(math.copysign(best * s, v) if best else 0.0)
    return torch.tensor(out).reshape(t.shape)


def naive_int2(t: torch.Tensor, block: int) -> torch.Tensor:
    """Each value to the nearest of -1, -1/3, 1/3, 1 times its block's absmax (a tie goes up)."""
    flat = t.reshape(-1).tolist()
    out = []
    for b in range(0, len(flat), block):
        blk = flat[b : b + block]
        s = max(abs(v) for v in blk)
        levels = [-1.0, -1.0 / 3, 1.0 / 3, 1.0]
        for v in blk:
            y = v / s if s else 0.0
            out.append(min(levels, key=lambda lv: (abs(lv - y), -lv)) * s)
    return torch.tensor(out).reshape(t.shape)


def naive_int1(t: torch.Tensor, block: int) -> torch.Tensor:
    """Each value to its sign (0 counts as +) times the mean |value| of its block (a short last
    block: of its own values)."""
    flat = t.reshape(-1).tolist()
    out = []
    for b in range(0, len(flat), block):
        blk = flat[b : b + block]
        s = sum(abs(v) for v in blk) / len(blk)
        out += [s if v >= 0 else -s for v in blk]
    return torch.tensor(out).reshape(t.shape)


def naive_ternary(t: torch.Tensor, block: int) -> torch.Tensor:
    """Block by block: a value whose |value| is over 0.7 times the block's mean |value| keeps its
    sign times the mean |value| of those kept, the rest are 0."""
    flat = t.reshape(-1).tolist()
    out = []
    for b in range(0, len(flat), block):
        blk = flat[b : b + block]
        threshold = 0.7 * sum(abs(v) for v in blk) / len(blk)
        kept = [abs(v) for v in blk if abs(v) > threshold]
        s = sum(kept) / len(kept) if kept else 0.0
        out += [math.copysign(s, v) if abs(v) > threshold else 0.0 for v in blk]
    return torch.tensor(out).reshape(t.shape)


def naive_topk(t: torch.Tensor, k: int, chunk: int, bits: int) -> torch.Tensor:
    """Chunk by chunk: the ceil(k·s/chunk) largest |values|, magnitudes to the nearest of
    2^(bits-1) levels from the chunk's smallest sent magnitude to its largest, the rest 0."""
    flat = t.reshape(-1)
    out = torch.zeros_like(flat)
    levels = 2 ** (bits - 1) - 1
    for start in range(0, flat.numel(), chunk):
        c = flat[start : start + chunk]
        kk = max(1, -(-k * c.numel() // chunk))
        idx = sorted(range(c.numel()), key=lambda i: -abs(float(c[i])))[:kk]
        mags = [abs(float(c[i])) for i in idx]
        lo, hi = min(mags), max(mags)
        for i in idx:
            q = round((abs(float(c[i])) - lo) / (hi - lo) * levels) if hi > lo else 0
            out[start + i] = math.copysign(lo + (hi - lo) * q / levels, float(c[i]))
    return out.reshape(t.shape)


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(13, 29, generator=g), "b": torch.randn(7, generator=g) * 1e-3,
            "big": torch.randn(300, generator=g) * torch.linspace(0.01, 10, 300), "z": torch.zeros(70),
            "e": torch.zeros(0), "steps": torch.tensor([3], dtype=torch.int64)}


def _specs(d: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    return ({n: (t.dtype, tuple(t.shape)) for n, t in d.items()}, {n: t.dtype for n, t in d.items()},
            {n: tuple(t.shape) for n, t in d.items()})


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.scheme}-{c.k}-{c.bits}")
def test_round_trip_through_a_body_matches_the_naive_reference(codec: Codec) -> None:
    delta = _model()
    spec, dtypes, shapes = _specs(delta)
    tensors, meta = compress(delta, codec)
    body = EncodedBody(tensors, meta)
    assert {n: (s.dtype, s.shape) for n, s in body.specs.items()} == expected_specs(spec, codec)
    out = dict(decompress(read_tensors(body, expected_digest=body.digest()), meta, dtypes, shapes))
    assert set(out) == set(delta) and torch.equal(out["steps"], delta["steps"])
    for name in ("w", "b", "big", "z", "e"):
        ref = (naive_e3m0(delta[name], codec.block) if codec.scheme == "e3m0"
               else naive_int2(delta[name], codec.block) if codec.scheme == "int2"
               else naive_int1(delta[name], codec.block) if codec.scheme == "int1"
               else naive_ternary(delta[name], codec.block) if codec.scheme == "ternary"
               else naive_topk(delta[name], codec.k, codec.chunk, codec.bits))
        assert out[name].shape == delta[name].shape and out[name].dtype == torch.float32
        torch.testing.assert_close(out[name], ref, rtol=1e-6, atol=1e-7)


def test_topk_sends_the_largest_entries_and_few_bytes() -> None:
    t = torch.zeros(4096)
    t[[5, 700, 4000]] = torch.tensor([3.0, -2.5, 1.0])
    t[100] = 0.5  # the fourth largest: not sent with k = 3
    tensors, meta = compress({"t": t}, Codec("topk", k=3, chunk=4096, bits=2))
    out = dict(decompress(tensors.items(), meta, shapes={"t": (4096,)}))["t"]
    assert out.nonzero().view(-1).tolist() == [5, 700, 4000]
    assert out[5] == 3.0 and out[700] == -3.0 and out[4000] == 1.0  # 2 bits: the levels are lo and hi
    assert sum(v.numel() * v.element_size() for v in tensors.values()) == 8 + 6 + 1


def test_config_density_gives_the_entries_per_chunk() -> None:
    from fedtrain.config import TrainConfig

    codec = Codec.for_train(TrainConfig(compression="topk", topk_density=0.02, topk_chunk=4096, topk_bits=4))
    assert (codec.k, codec.chunk, codec.bits) == (82, 4096, 4)
    assert Codec.of(codec.metadata()) == codec


@pytest.mark.parametrize("codec", CODECS[:3], ids=lambda c: f"{c.scheme}-{c.k}-{c.bits}")
def test_error_feedback_sums_to_the_true_delta_over_rounds(codec: Codec) -> None:
    """Σ sent + the final residual = Σ Δ: nothing compression dropped is lost."""
    g = torch.Generator().manual_seed(4)
    fb = ErrorFeedback()
    sent_sum = torch.zeros(500, dtype=torch.float64)
    true_sum = torch.zeros(500, dtype=torch.float64)
    for _ in range(12):
        delta = torch.randn(500, generator=g)
        tensors, meta = fb.compress({"x": delta}, codec)
        sent_sum += dict(decompress(tensors.items(), meta, shapes={"x": (500,)}))["x"].double()
        true_sum += delta.double()
    torch.testing.assert_close(sent_sum + fb.residual["x"].double(), true_sum, rtol=0, atol=1e-4)
    if codec.scheme == "topk":  # the residual is what was not sent yet: far from zero, bounded
        assert float(fb.residual["x"].abs().max()) > 0.5


@pytest.mark.parametrize("codec", CODECS[:3], ids=lambda c: f"{c.scheme}-{c.k}-{c.bits}")
def test_decayed_error_feedback_follows_the_naive_recurrence(codec: Codec) -> None:
    """β < 1 (SparseLoCo's accumulator): e ← β·e + Δ, send C(e), e ← e − C(e), in plain torch."""
    g = torch.Generator().manual_seed(5)
    beta = 0.8
    fb = ErrorFeedback(decay=beta)
    e = torch.zeros(500)
    for _ in range(6):
        delta = torch.randn(500, generator=g)
        tensors, meta = fb.compress({"x": delta}, codec)
        sent = dict(decompress(tensors.items(), meta, shapes={"x": (500,)}))["x"]
        e = beta * e + delta
        ref_tensors, ref_meta = compress({"x": e}, codec)
        want = dict(decompress(ref_tensors.items(), ref_meta, shapes={"x": (500,)}))["x"]
        torch.testing.assert_close(sent, want, rtol=0, atol=1e-6)
        e = e - want
        torch.testing.assert_close(fb.residual["x"], e, rtol=0, atol=1e-5)


def _topk_parts(k: int = 3, chunk: int = 64, n: int = 140, bits: int = 2) -> tuple[torch.Tensor, ...]:
    t = torch.randn(n, generator=torch.Generator().manual_seed(2))
    tensors, _ = compress({"t": t}, Codec("topk", k=k, chunk=chunk, bits=bits))
    return tensors["t::scale"].clone(), tensors["t::idx"].clone(), tensors["t"].clone()


def test_topk_decode_checks_every_part() -> None:
    scales, idx, codes = _topk_parts()
    positions, _ = topk_decode(scales, idx, codes, 140, 3, 64, 2, "t")
    assert positions.tolist() == sorted(set(positions.tolist())) and len(positions) == 3 + 3 + 1
    bad = idx.clone()
    bad[0] = 64  # outside chunk 0
    with pytest.raises(WireError, match="outside"):
        topk_decode(scales, bad, codes, 140, 3, 64, 2, "t")
    bad = idx.clone()
    bad[6] = 12  # the last chunk holds 140 - 128 = 12 values, and sends ceil(3 * 12 / 64) = 1
    with pytest.raises(WireError, match="chunk 2 is outside"):
        topk_decode(scales, bad, codes, 140, 3, 64, 2, "t")
    bad = idx.clone()
    bad[4] = bad[3]  # a duplicate in chunk 1
    with pytest.raises(WireError, match="chunk 1 are not strictly increasing"):
        topk_decode(scales, bad, codes, 140, 3, 64, 2, "t")
    for value in (float("nan"), float("inf"), -1.0):
        bad = scales.clone()
        bad[1, 1] = value
        with pytest.raises(WireError, match="finite and non-negative"):
            topk_decode(bad, idx, codes, 140, 3, 64, 2, "t")
    bad = scales.clone()
    bad[0] = torch.tensor([2.0, 1.0])
    with pytest.raises(WireError, match="smallest magnitude is above"):
        topk_decode(bad, idx, codes, 140, 3, 64, 2, "t")
    with pytest.raises(WireError, match="3 chunks"):
        topk_decode(scales[:2], idx, codes, 140, 3, 64, 2, "t")
    bad = codes.clone()
    bad[-1] |= 0xC0  # the padding after the 7th code of 2 bits
    with pytest.raises(WireError, match="padding"):
        topk_decode(scales, idx, bad, 140, 3, 64, 2, "t")


def test_pack_round_trip() -> None:
    for bits in (2, 4):
        codes = torch.randint(0, 1 << bits, (37,), dtype=torch.uint8)
        assert torch.equal(unpack(pack(codes, bits), bits, 37), codes)


def test_metadata_is_checked_before_any_tensor() -> None:
    def topk(k: str, chunk: str, bits: str) -> dict[str, str]:
        return {"fedtrain.compression": "topk", "fedtrain.topk": k, "fedtrain.chunk": chunk, "fedtrain.bits": bits}

    for meta in ({"fedtrain.compression": "topk"},  # no parameters
                 topk("5", "4", "2"), topk("5", "70000", "2"), topk("5", "64", "3"), topk("-5", "64", "2"),
                 topk("9" * 40, "64", "2"), topk("17", "64", "2"),
                 topk("5", "64", "\u0662")):  # a digit, but not an ASCII one
        with pytest.raises(WireError):
            Codec.of(meta)


def test_parts_out_of_order_are_refused() -> None:
    tensors, meta = compress({"t": torch.randn(100)}, Codec("topk", k=3, chunk=64))
    reordered = [("t", tensors["t"]), ("t::scale", tensors["t::scale"]), ("t::idx", tensors["t::idx"])]
    with pytest.raises(WireError, match="comes before its scales"):
        list(decode_parts(reordered, meta, {"t": torch.float32}, {"t": (100,)}))
    with pytest.raises(WireError, match="without their tensors"):
        list(decode_parts([("t::scale", tensors["t::scale"])], meta, {"t": torch.float32}, {"t": (100,)}))


def test_a_sparse_fold_equals_the_dense_fold_of_the_decoded_update() -> None:
    model = {"w": torch.zeros(13, 29), "big": torch.zeros(300)}
    updates = [{"w": torch.randn(13, 29) * (i + 1), "big": torch.randn(300)} for i in range(3)]
    weights = [3.0, 1.0, 2.0]
    codec = Codec("topk", k=7, chunk=64, bits=4)
    shapes = {n: tuple(t.shape) for n, t in model.items()}
    sparse_sum, dense_sum = RunningSum(model), RunningSum(model)
    for u, w in zip(updates, weights, strict=True):
        tensors, meta = compress(u, codec)
        for name, at, values in decode_parts(tensors.items(), meta, None, shapes):
            assert at is not None and values.numel() < model[name].numel() // 4  # never densified
            sparse_sum.fold_sparse(name, at, values, w)
        sparse_sum.finish_contribution(w)
        dense_sum.add(dict(decompress(tensors.items(), meta, None, shapes)), w)
    got, want = sparse_sum.mean(), dense_sum.mean()
    for name in model:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)
    with pytest.raises(MergeError, match="outside"):
        s = RunningSum(model)
        s.fold_sparse("big", torch.tensor([300]), torch.ones(1), 1.0)


def test_switching_compression_off_sends_what_error_feedback_held() -> None:
    fb = ErrorFeedback()
    delta = torch.randn(500, generator=torch.Generator().manual_seed(6))
    tensors, meta = fb.compress({"x": delta}, Codec("topk", k=3, chunk=64))
    sent = dict(decompress(tensors.items(), meta, shapes={"x": (500,)}))["x"]
    tensors, meta = fb.compress({"x": torch.zeros(500)}, Codec("none"))
    torch.testing.assert_close(sent + tensors["x"], delta)  # the rest of Δ went with the next upload
    assert fb.residual == {}


def test_error_feedback_takes_a_non_contiguous_delta_and_leaves_it_alone() -> None:
    fb = ErrorFeedback()
    base = torch.randn(64, 96, generator=torch.Generator().manual_seed(7))
    delta = base.t()  # not contiguous
    kept = delta.clone()
    for _ in range(2):
        tensors, meta = fb.compress({"x": delta}, Codec("topk", k=4, chunk=64))
    assert torch.equal(delta, kept)
    sent = dict(decompress(tensors.items(), meta, shapes={"x": (96, 64)}))["x"]
    assert fb.residual["x"].shape == (96, 64) and float(sent.abs().sum()) > 0


def test_ternary_packs_five_codes_a_byte_in_base_3_and_checks_each_byte() -> None:
    codes = torch.tensor([2, 0, 1, 1, 2, 1, 2], dtype=torch.uint8)
    packed = pack_base3(codes)
    assert packed.tolist() == [2 + 0 * 3 + 1 * 9 + 1 * 27 + 2 * 81, 1 + 2 * 3]
    assert torch.equal(unpack_base3(packed, 7), codes)
    with pytest.raises(WireError, match="over 242"):  # no five base-3 digits
        unpack_base3(torch.tensor([243, 0], dtype=torch.uint8), 7)
    with pytest.raises(WireError, match="padding"):  # the eighth code (padding) is 1, not 0
        unpack_base3(torch.tensor([0, 27], dtype=torch.uint8), 7)
    with pytest.raises(WireError, match="take 2 bytes"):
        unpack_base3(packed[:1], 7)
    x = torch.randn(1000)
    tensors, _ = compress({"x": x}, Codec("ternary", block=250))
    assert tensors["x"].numel() == 200 and tensors["x::scale"].numel() == 4  # 1.6 bits a value, 4 scales


def test_ternary_keeps_the_large_values_and_zeroes_the_small() -> None:
    x = torch.tensor([4.0, -3.0, 0.1, -0.2, 0.0, 0.05, 2.5, -0.1])  # mean |x| 1.25: 0.7 of it 0.875
    tensors, meta = compress({"x": x}, Codec("ternary", block=8))
    out = dict(decompress(tensors.items(), meta, shapes={"x": (8,)}))["x"]
    assert torch.allclose(out, torch.tensor([1.0, -1.0, 0, 0, 0, 0, 1.0, 0]) * (9.5 / 3))
