"""Compressed downloads' math (`wire/delta.py`): the delta against a naive pure-torch reference,
bit-identity of the coordinator's and a participant's result, and server-side error feedback
summing to the true outer steps over rounds."""

from __future__ import annotations

import pytest
import torch

from fedtrain.errors import WireError
from fedtrain.wire import EncodedBody, read_tensors
from fedtrain.wire.compress import Codec, decompress
from fedtrain.wire.delta import (
    apply_delta,
    delta_metadata,
    download_codec,
    encode_delta,
    info_of,
    target_body,
)

CODECS = [Codec("int8", 64), Codec("e3m0", 64), Codec("int2", 64), Codec("int1", 64), Codec("ternary", 64),
          Codec("topk", 64, k=26, chunk=256, bits=2), Codec("topk", 64, k=8, chunk=128, bits=4)]

#: topk downloads need an outer step without momentum (config/compression.py).
NO_MOMENTUM = {"algorithm": "fedavg"}


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 33, generator=g), "b": torch.randn(7, generator=g),
            "e": torch.randn(3, 100, generator=g)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _wire(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Through a real body and back, as a participant reads it."""
    got: dict[str, str] = {}
    body = b"".join(bytes(v) for v in EncodedBody(tensors, meta))
    out = dict(read_tensors(iter([body]), on_header=lambda _s, m: got.update(m)))
    return out, got


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.scheme}{c.bits if c.sparse else ''}")
def test_delta_matches_a_naive_reference(codec: Codec) -> None:
    prev = _model(0)
    g = {n: t + 0.01 * torch.randn_like(t) for n, t in prev.items()}
    step = {n: g[n] - prev[n] for n in prev}
    new = {n: t.clone() for n, t in g.items()}
    body, meta, residual = encode_delta(prev, new, {}, codec)
    shapes = {n: tuple(t.shape) for n, t in prev.items()}
    decoded = dict(decompress(body.items(), meta, shapes=shapes))  # dense, the naive way
    for n in prev:
        naive = prev[n] + decoded[n]  # P + decode(C), plain torch
        assert torch.equal(new[n], naive), n
        assert torch.allclose(residual[n], step[n] - decoded[n], atol=1e-6), n  # E = D - decode(C)
        if codec.sparse:  # the entries sent are each chunk's largest |D| (naive: torch.topk per chunk)
            flat, sent = step[n].reshape(-1), decoded[n].reshape(-1) != 0
            for c0 in range(0, flat.numel(), codec.chunk):
                chunk = flat[c0 : c0 + codec.chunk]
                k = max(1, -(-codec.k * chunk.numel() // codec.chunk))
                top = set(torch.topk(chunk.abs(), k).indices.tolist())
                assert set(torch.nonzero(sent[c0 : c0 + codec.chunk]).view(-1).tolist()) <= top
        else:  # dense codecs: every value within its block's quantization step (int1, the sign times
            # the block's mean |value|, and ternary, a mean of |values| or 0: within the largest |value|)
            bound = float(step[n].abs().max()) / (1 if codec.scheme in ("int1", "ternary") else 2)
            assert float((decoded[n] - step[n]).abs().max()) <= bound


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.scheme}{c.bits if c.sparse else ''}")
def test_participant_result_is_bit_identical_and_digest_checks(codec: Codec) -> None:
    prev = _model(1)
    new = {n: t + 0.02 * torch.randn_like(t) for n, t in prev.items()}
    body, meta, _ = encode_delta(prev, new, {}, codec)
    target_meta = {"run": "r", "algorithm": "diloco", "version": "5"}
    served = EncodedBody(new, target_meta)
    full_meta = {**meta, **delta_metadata(codec, 4, 5, served.digest(), target_meta)}
    tensors, got_meta = _wire(body, full_meta)
    info = info_of(got_meta)
    assert (info.from_version, info.to_version, info.metadata) == (4, 5, target_meta)
    held = {n: t.clone() for n, t in prev.items()}
    mine = apply_delta(held, tensors, got_meta, out=held)  # in place, as a participant does
    for n in prev:
        assert torch.equal(_bits(mine[n]), _bits(new[n])), n
    assert target_body(mine, info).digest() == served.digest()
    other = dict(mine)
    other["b"] = other["b"].clone()
    other["b"][0] = torch.nextafter(other["b"][0], torch.tensor(9.0))  # one ulp off: the digest says so
    assert target_body(other, info).digest() != served.digest()


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.scheme}{c.bits if c.sparse else ''}")
def test_server_error_feedback_sums_to_the_true_steps(codec: Codec) -> None:
    p0 = _model(2)
    published = {n: t.clone() for n, t in p0.items()}
    residual: dict[str, torch.Tensor] = {}
    total = {n: torch.zeros_like(t) for n, t in p0.items()}
    g = torch.Generator().manual_seed(3)
    for _ in range(12):
        step = {n: 0.01 * torch.randn(t.shape, generator=g) for n, t in p0.items()}
        for n in total:
            total[n] += step[n]
        prev = {n: t.clone() for n, t in published.items()}
        published = {n: prev[n] + step[n] for n in prev}  # G: the outer step from P_r
        _, _, residual = encode_delta(prev, published, residual, codec)
    for n in p0:  # P_R + E_R = P_0 + the sum of every outer step (float rounding only)
        assert torch.allclose(published[n] + residual[n], p0[n] + total[n], atol=1e-5), n
    if codec.sparse:  # and the residual is real: what topk has not sent yet
        assert any(float(r.abs().max()) > 1e-3 for r in residual.values())


def test_bad_deltas_are_refused() -> None:
    prev = _model(4)
    codec = Codec("int8", 64)
    body, meta, _ = encode_delta(prev, {n: t + 1 for n, t in prev.items()}, {}, codec)
    with pytest.raises(WireError, match="leaves out"):
        apply_delta(prev, {k: v for k, v in body.items() if not k.startswith("b")}, meta)
    with pytest.raises(WireError, match="does not hold"):
        apply_delta({"w": prev["w"], "e": prev["e"]}, body, meta)
    with pytest.raises(WireError, match="float32"):
        apply_delta({n: t.double() for n, t in prev.items()}, body, meta)
    with pytest.raises(WireError, match="none"):
        encode_delta(prev, prev, {}, Codec("none"))
    good = delta_metadata(codec, 3, 4, "xxh3-128:" + "0" * 32, {"a": "b"})
    for key, value in [("fedtrain.delta.to", "9"), ("fedtrain.delta.meta", "[1]"), ("fedtrain.delta.meta", "{"),
                       ("fedtrain.delta.from", "x")]:
        with pytest.raises(WireError):
            info_of({**good, key: value})
    with pytest.raises(WireError):
        info_of({k: v for k, v in good.items() if k != "fedtrain.delta.digest"})


# -- the config and the checkpoint -----------------------------------------------------------------


def test_download_codec_follows_the_train_section() -> None:
    from tests.helpers.config import tiny_config

    assert download_codec(tiny_config().train) is None
    assert download_codec(tiny_config(train={"download_compression": "int8", "compression_block": 64}).train) == \
        Codec("int8", 64)
    topk = tiny_config(outer=NO_MOMENTUM, train={"download_compression": "topk", "topk_chunk": 1000,
                                                 "topk_density": 0.05, "topk_bits": 4}).train
    assert download_codec(topk) == Codec("topk", 256, k=50, chunk=1000, bits=4)
    own = tiny_config(outer=NO_MOMENTUM, train={"download_compression": "topk", "topk_chunk": 1000,
                                                "download_topk_density": 0.01}).train
    assert download_codec(own) == Codec("topk", 256, k=10, chunk=1000, bits=2)


@pytest.mark.parametrize("bad", [{"download_compression": "bf16"}, {"download_compression": "zstd"},
                                 {"download_topk_density": 0.5}, {"download_topk_density": 0.0},
                                 {"download_topk_density": "x"}])
def test_download_fields_have_bounds(bad: dict) -> None:
    from pydantic import ValidationError

    from tests.helpers.config import tiny_config

    with pytest.raises(ValidationError):
        tiny_config(train=bad)


def test_compressed_downloads_compose_with_streaming() -> None:
    from tests.helpers.config import tiny_config

    cfg = tiny_config(streaming={"fragments": 2}, train={"sync_every": 4, "download_compression": "int8"})
    assert cfg.train.download_compression == "int8" and cfg.streaming is not None


def test_a_fragments_delta_moves_its_tensors_only() -> None:
    """Streaming DiLoCo: the step moved the fragment's tensors; its delta holds them alone, the
    others' residual stays, and a participant's partial apply leaves the others as they were."""
    from fedtrain.coordinator.model.deltas import DownloadDeltas
    from fedtrain.coordinator.model.publish import Published

    params = _model(8)
    start = {n: t.clone() for n, t in params.items()}
    deltas = DownloadDeltas()
    deltas.configure(Codec("int8", 64))
    deltas.residual = {"b": torch.full((7,), 0.5)}  # as an earlier round left it
    prev = deltas.before_step(params, ["w"])
    assert prev is not None and set(prev) == {"w"}
    params["w"] += 0.01  # the fragment's outer step
    deltas.encode(prev, params)
    assert torch.equal(deltas.residual["b"], torch.full((7,), 0.5)) and "w" in deltas.residual
    assert torch.equal(params["b"], start["b"]) and torch.equal(params["e"], start["e"])
    target = EncodedBody(params, {"version": "1"})
    published = deltas.publish(Published(1, target.digest(), target, 0))
    assert published is not None and published.from_version == 0
    meta: dict[str, str] = {}
    raw = b"".join(bytes(v) for v in published.body)  # the delta body as it is served
    tensors = dict(read_tensors(iter([raw]), on_header=lambda _s, m: meta.update(m)))
    assert {n.split("::")[0] for n in tensors} == {"w"} and info_of(meta).digest == target.digest()
    held = {n: t.clone() for n, t in start.items()}
    with pytest.raises(WireError, match="leaves out"):
        apply_delta(held, tensors, meta)
    apply_delta(held, tensors, meta, out=held, partial=True)
    assert all(torch.equal(held[n], params[n]) for n in params)


def test_the_residual_checkpoint_round_trips_and_a_damaged_one_is_none(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from fedtrain.coordinator.model.checkpoints import CheckpointDir

    ckpt = CheckpointDir(tmp_path / "ckpt")
    residual = _model(7)
    assert ckpt.load_residual(3) is None  # none written: E = 0
    ckpt.write_residual(3, residual, None)
    back = ckpt.load_residual(3)
    assert back is not None and all(torch.equal(back[n], residual[n]) for n in residual)
    assert 3 in ckpt.versions()
    path = ckpt.residual_path(3)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # one flipped bit in the last tensor
    path.write_bytes(bytes(raw))
    assert ckpt.load_residual(3) is None
    ckpt.remove(3)
    assert not path.exists()


def test_a_live_change_of_download_compression_says_what_it_implies() -> None:
    from fedtrain.config.changes import change_notes
    from tests.helpers.config import tiny_config

    off, on = tiny_config(), tiny_config(outer=NO_MOMENTUM, train={"download_compression": "topk"})
    assert any("downloads the model whole once more" in n for n in change_notes(off, on))
    assert any("drops the residual" in n for n in change_notes(on, off))
    other = tiny_config(train={"download_compression": "int8"})
    assert any("residual carried on" in n for n in change_notes(on, other))
    assert not [n for n in change_notes(on, on) if "download_compression" in n]


@pytest.mark.parametrize("outer", [{}, {"algorithm": "fedavgm"}, {"algorithm": "fedavg", "momentum": 0.5}])
@pytest.mark.parametrize("train", [{"compression": "topk"}, {"download_compression": "topk"}])
def test_topk_with_an_outer_momentum_is_refused_with_the_reason(outer: dict, train: dict) -> None:
    """topk 1% with DiLoCo's Nesterov outer step diverged in docs/quality.md's study: refused, up
    or down, for any outer optimizer with momentum (diloco by default, fedavgm, an explicit one)."""
    import pydantic

    from tests.helpers.config import tiny_config

    with pytest.raises(pydantic.ValidationError, match="outer optimizer with momentum") as e:
        tiny_config(outer=outer, train=train)
    assert "outer.algorithm fedavg" in str(e.value)
    tiny_config(outer={"algorithm": "fedavg"}, train=train)  # outer SGD without momentum: fine
    tiny_config(outer={"algorithm": "fedadam"}, train=train)
    tiny_config(outer=outer, train={k: "int8" for k in train})  # a dense codec composes with momentum
