"""Sparse uploads end to end over loopback: two participants training with topk uploads (the
loss falls, each ends on the global model, each upload a small share of the model's bytes);
the coordinator's merge of two topk bodies equal to a reference merge of their decoded
updates; an update sent as two topk pieces (FSDP ranks, each compressing its rows) merged as
its decoded rows; Streaming DiLoCo fragments each sent as a topk body."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedtrain.cli.report import format_status
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.merge import weighted_mean
from fedtrain.wire import DIGEST_HEADER, EncodedBody
from fedtrain.wire.compress import Codec, compress, decompress
from tests.helpers.api import client
from tests.helpers.config import tiny_config
from tests.helpers.runs import assert_all_on, heldout_loss, train_all


def test_two_participants_train_with_topk_uploads(tmp_path: Path) -> None:
    train = {"sync_every": 10, "lr": 1e-2, "compression": "topk", "topk_density": 0.05, "topk_chunk": 256,
             "topk_bits": 4}
    cfg = tiny_config(rounds=5, train=train, min_participants=2, outer={"algorithm": "fedavg"})
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        initial = heldout_loss(c.service.inspect().weights)
        results = train_all(c.url, 2)
        final_global = {k: v.clone() for k, v in c.service.inspect().weights.items()}
        model_bytes = sum(t.numel() * t.element_size() for t in final_global.values())
        rounds = c.service.round_history()
        status = c.service.status()
    assert all(r["n_submissions"] == 2 for r in rounds)
    # the status shows each round's bytes up against fp32 and the bytes down of the version it made
    model_fp32 = sum(4 * t.numel() for t in final_global.values())
    for r in status["recent_rounds"]:
        assert r["fp32_bytes_in"] == 2 * model_fp32
        assert r["vs_fp32_in"] == round(2 * model_fp32 / r["bytes_in"], 2) and r["vs_fp32_in"] > 10
        assert r["bytes_out"] >= 2 * model_fp32  # both participants fetched the version the round made
    shown = format_status(status)
    assert "fp32 / up" in shown and f"{status['recent_rounds'][0]['vs_fp32_in']:g}x" in shown
    per_upload = rounds[0]["bytes_in"] / rounds[0]["n_submissions"]
    # 5% of the values, each a 2-byte offset and 4 bits, plus 8 bytes a chunk and the header
    assert per_upload <= model_bytes * 0.05 + 16_384, (per_upload, model_bytes)
    assert_all_on(results, final_global)
    assert heldout_loss(final_global) < initial - 1.0


def test_the_merge_of_topk_updates_is_the_mean_of_their_decoded_values(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "fedavg"}, min_participants=2)
    codec = Codec("topk", k=5, chunk=128, bits=2)
    with BackgroundCoordinator(tmp_path / "state", cfg) as c, client(c) as http:
        for name in ("a", "b"):
            http.post("/v1/join", json={"name": name})
        before = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        shapes = {n: tuple(t.shape) for n, t in before.items()}
        decoded, tokens = [], [30, 10]
        for i, (pid, tok) in enumerate(zip(("a", "b"), tokens, strict=True)):
            g = torch.Generator().manual_seed(i)
            delta = {n: torch.randn(t.shape, generator=g) * 1e-2 for n, t in before.items()}
            tensors, meta = compress(delta, codec)
            decoded.append(dict(decompress(tensors.items(), meta, shapes=shapes)))
            enc = EncodedBody(tensors, meta)
            r = http.put(f"/v1/rounds/0/updates/{pid}", params={"tokens": tok},
                         content=b"".join(bytes(x) for x in enc), headers={DIGEST_HEADER: enc.digest()})
            assert r.status_code == 200, r.text
        assert http.get("/v1/rounds/0", params={"wait": 10}).json()["state"] == "closed"
        after = c.service.inspect().weights
        mean = weighted_mean(decoded, [0.75, 0.25])  # max_share caps 30:10 at (1 + 0.5) / 2
        for n, t in before.items():
            torch.testing.assert_close(after[n], t - mean[n], rtol=1e-6, atol=1e-7)
            assert int((mean[n] != 0).sum()) <= 2 * (5 * -(-t.numel() // 128))  # sparse, as sent


@pytest.mark.parametrize("codec", [Codec("topk", k=3, chunk=64, bits=4), Codec("int2", 64, deflate=True)],
                         ids=["topk", "int2_deflate"])
def test_topk_pieces_of_an_update_make_the_update_their_rows_decode_to(tmp_path: Path, codec: Codec) -> None:
    """Two FSDP ranks each send their rows as a topk piece, or as int2 with deflated codes
    (each compresses its own rows): the update the coordinator assembles and merges is the two
    decoded pieces, row by row."""
    import json

    from fedtrain.coordinator.intake.pieces import ROWS_META
    from tests.helpers.api import halves

    cfg = tiny_config(outer={"algorithm": "fedavg"})
    with BackgroundCoordinator(tmp_path / "state", cfg) as c, client(c) as http:
        http.post("/v1/join", json={"name": "a"})
        before = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        g = torch.Generator().manual_seed(5)
        delta = {n: torch.randn(t.shape, generator=g) * 1e-2 for n, t in before.items()}
        parts: list[dict[str, torch.Tensor]] = []
        for label, (piece, rows) in zip(("r0", "r1"), halves(delta), strict=True):
            tensors, meta = compress(piece, codec)
            parts.append(dict(decompress(tensors.items(), meta, shapes={n: tuple(t.shape) for n, t in piece.items()})))
            enc = EncodedBody(tensors, {**meta, ROWS_META: json.dumps(rows)})
            r = http.put("/v1/rounds/0/updates/a", params={"tokens": 10, "piece": label},
                         content=b"".join(bytes(x) for x in enc), headers={DIGEST_HEADER: enc.digest()})
            assert r.status_code == 200, r.text
        assert http.get("/v1/rounds/0", params={"wait": 10}).json()["state"] == "closed"
        after = c.service.inspect().weights
        for n, t in before.items():
            sent = torch.cat([p[n] for p in parts if n in p]) if t.dim() else parts[0][n]
            torch.testing.assert_close(after[n], t - sent.reshape(t.shape), rtol=1e-6, atol=1e-7)


def test_topk_deltas_with_error_feedback_per_streaming_fragment(tmp_path: Path) -> None:
    """Streaming DiLoCo (K = 2, τ = 1): every upload is one fragment's topk body, and the run trains."""
    from tests.helpers.runs import FRAGMENTS, initial_model
    from tests.helpers.streaming import Fixed, streaming_config
    from tests.helpers.tiny import TinyParticipant, init_file, run_all

    cfg = streaming_config(6, 4, {"fragments": 2, "assign": FRAGMENTS, "overlap": 1, "alpha": 0.5},
                           train={"compression": "topk", "topk_density": 0.25, "topk_chunk": 64, "topk_bits": 4},
                           outer={"algorithm": "fedavg"})
    tasks = [Fixed(rows=16, seed=30 + i) for i in range(2)]
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, initial_model())) as c:
        start_loss = [t.build().loss(initial_model(), t.build().batch()).item() for t in tasks]
        runners = run_all([TinyParticipant(c.url, f"p{i}", task) for i, task in enumerate(tasks)])
        recent = c.service.status()["recent_rounds"]
    for rnd in recent:  # fp32 of the round's fragment only, as many times as it had updates
        prefix = ("lin.", "head.")[rnd["fragment"]]
        fp32 = sum(4 * t.numel() for n, t in initial_model().state_dict().items() if n.startswith(prefix))
        assert rnd["fp32_bytes_in"] == rnd["n_submissions"] * fp32
    for r, before in zip(runners, start_loss, strict=True):
        assert r.fed is not None and r.fed.round == 6 and r.losses[-1] < before
        assert [rec["fragment"] for rec in r.fed.history] == [0, 1, 0, 1, 0, 1]
        model = initial_model().state_dict()
        for rec in r.fed.history:  # each upload is its fragment's topk body, byte for byte in size
            prefix = ("lin.", "head.")[rec["fragment"]]
            fragment = {n: torch.zeros_like(t) for n, t in model.items() if n.startswith(prefix)}
            tensors, meta = compress(fragment, Codec.for_train(cfg.train))
            assert rec["bytes_up"] == EncodedBody(tensors, meta).content_length
