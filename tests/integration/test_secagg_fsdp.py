"""FSDP pieces under secure aggregation: an update that comes in as its ranks' masked pieces (each
a flat element range of every tensor, masked at its offset) is folded into the ring sum once the
pieces cover the round's tensors, and commits what the plain merge commits within fixed-point
rounding; a group whose pieces do not cover them at the close is dropped like any dropout, and the
round merges the others. End to end: a 2-rank FSDP group (gloo, CPU, torchrun) beside a
single-process participant, 2 rounds, whose merges equal the plain token-weighted mean of the
local models they sent, and never a float byte on the wire."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers import zygote
from tests.helpers.api import client
from tests.helpers.config import ATOKEN, tiny_config
from tests.helpers.processes import track
from tests.helpers.secagg import Site, ok, reveal_and_commit, run_to_upload
from tests.helpers.torchrun import WORKERS, finished, rank_env, worker_group

pytest.importorskip("cryptography")

N_MAX = 4  # a 2^16 ring with p = 13 bits: a unit of R / 8191
RANGE = 0.5
SECAGG = {"secure_aggregation": True, "dp": False, "secagg_max_participants": N_MAX, "secagg_range": RANGE}
TOKENS = {"a": 100, "b": 100, "g": 200}  # g: an FSDP group, its update in pieces


def unit() -> float:
    return RANGE / (2**13 - 1)


def deltas(c: BackgroundCoordinator) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return {pid: {n: (torch.rand(t.shape, generator=g) - 0.5) * 0.4 for n, t in c.service.inspect().weights.items()}
            for pid in TOKENS}


def whole_uploads_in(c: BackgroundCoordinator, http: httpx.Client) -> tuple[
        dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], list[Site]]:
    """Round 0 up to g's pieces: a, b and g join and run the protocol to the upload phase, a and b
    upload whole. The model before, everyone's Δ, the sites a, b, g."""
    for pid in TOKENS:
        ok(http.post("/v1/join", json={"name": pid}))
    before = {n: t.clone() for n, t in c.service.inspect().weights.items()}
    ds = deltas(c)
    sites = [Site(http, pid) for pid in TOKENS]
    run_to_upload(sites, TOKENS)
    for s in sites[:2]:
        ok(s.upload(s.masked(ds[s.pid]), TOKENS[s.pid]))
    return before, ds, sites


def test_masked_pieces_commit_what_the_plain_mean_commits(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy=SECAGG)
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        before, ds, sites = whole_uploads_in(c, http)
        g = sites[2]
        first, second = g.masked_pieces(ds["g"])
        got = ok(g.upload_piece("rank0", first, TOKENS["g"]))
        assert got["complete"] is False and c.service.status()["secure_aggregation"]["uploaded"] == 2
        assert c.service.has_piece("g", 0, "rank0") and not c.service.has_piece("g", 0, "rank1")
        again = ok(g.upload_piece("rank0", first, TOKENS["g"]))  # a piece sent twice: answered, not taken twice
        assert again["duplicate"] is True
        got = ok(g.upload_piece("rank1", second, TOKENS["g"]))
        assert got["complete"] is True and got["pieces"] == 2
        reveal_and_commit(c, sites, 1)
        after = c.service.inspect().weights
        record = c.service.round_history(1)[0]
    assert record["n_submissions"] == 3
    for n, t in after.items():  # fedavg: θ − (¼Δa + ¼Δb + ½Δg), each off by at most half a unit
        want = before[n] - (ds["a"][n] + ds["b"][n] + 2 * ds["g"][n]) / 4
        assert torch.allclose(t, want, rtol=0, atol=3 * unit() / 2 + 1e-6), n


def test_a_group_missing_a_piece_at_the_close_is_dropped_and_the_others_merge(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "fedavg"}, round_timeout_s=3.0, privacy={**SECAGG, "secagg_threshold": 2})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        before, ds, sites = whole_uploads_in(c, http)
        a, b, g = sites
        first, _ = g.masked_pieces(ds["g"])
        ok(g.upload_piece("rank0", first, TOKENS["g"]))  # rank 1's piece never comes
        deadline = time.monotonic() + 15  # the round's deadline closes it without g's update
        while c.service.status()["secure_aggregation"]["phase"] != "reveal":
            assert time.monotonic() < deadline, c.service.status()["reason"]
            time.sleep(0.02)
        assert c.service.status()["secure_aggregation"]["uploaded"] == 2
        unmask = ok(http.get("/v1/rounds/0/secagg/unmask/a", params={"session": a.session}))
        assert unmask["dropped"] == [g.id]  # its masks are removed with the survivors' shares
        reveal_and_commit(c, [a, b], 1)
        after = c.service.inspect().weights
        record = c.service.round_history(1)[0]
        assert not c.service.has_piece("g", 0, "rank0")  # its piece went with the round
    assert record["n_submissions"] == 2
    for n, t in after.items():  # fedavg over the survivors: θ − (¼Δa + ¼Δb) / ½
        want = before[n] - (ds["a"][n] + ds["b"][n]) / 2
        assert torch.allclose(t, want, rtol=0, atol=2 * unit() / 2 / 0.5 + 1e-6), n


def local_model(out: Path, name: str, what: str) -> dict[str, torch.Tensor]:
    """A participant's model (its ranks' rows put together) as it sent it in round r
    (`what` "round<r>") or as it started round r from the global model ("start<r>")."""
    whole: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for path in sorted(out.glob(f"{name}-rank*-{what}.safetensors")):
        with safe_open(str(path), "pt") as f:
            rows = json.loads(f.metadata()["rows"])
            for n in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                whole.setdefault(n, []).append((rows[n][0], f.get_tensor(n)))
    return {n: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for n, parts in whole.items()}


def run_group_and_single(c: BackgroundCoordinator, out: Path) -> None:
    """A 2-rank FSDP group and a single process (`workers/secagg_worker.py`) to the run's end."""
    group = worker_group("secagg_worker.py", c.url, "group", str(out))
    single = track(zygote.popen([sys.executable, str(WORKERS / "secagg_worker.py"), c.url, "single", str(out)],
                                env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    finished(group)
    finished(single, timeout=60)


def test_an_fsdp_group_beside_a_single_process_merges_the_plain_mean_under_masks(tmp_path: Path) -> None:
    rounds = 2
    cfg = tiny_config(rounds=rounds, min_participants=2, outer={"algorithm": "fedavg"},
                      train={"sync_every": 3, "lr": 1e-2}, privacy=SECAGG)
    out = tmp_path / "out"
    out.mkdir()
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        run_group_and_single(c, out)
        final = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        history = c.service.round_history(10)  # newest first
        assert c.service.finished and c.service.status()["secure_aggregation"]["refused_attempts"] == 0
    params = sum(t.numel() for t in final.values())
    assert len(history) == rounds
    for rec in history:
        assert rec["n_submissions"] == 2
        # every byte in is a ring value (2 a parameter) or a header: no float piece ever came
        assert 2 * 2 * params < rec["bytes_in"] < 2 * 2 * params + 16 * 4096, rec["bytes_in"]
    for r, record in enumerate(history[::-1]):  # each round's merge: the next round's start, or the end
        merged = local_model(out, "single", f"start{r + 1}") if r + 1 < rounds else final
        weights = {s["participant_id"]: s["weight"] for s in record["submissions"]}
        assert weights["group"] > weights["single"]  # its two ranks' tokens
        sent = {pid: local_model(out, pid, f"round{r}") for pid in weights}
        for n, t in merged.items():  # fedavg: θ_new = Σ w θ_local, each contribution within half a unit
            want = sum(w * sent[pid][n] for pid, w in weights.items())
            assert torch.allclose(t, want, rtol=0, atol=2 * unit() / 2 + 1e-5), (r, n)


@pytest.mark.parametrize("dp", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_an_overlapped_fsdp_group_masks_its_pieces_on_the_worker_thread(tmp_path: Path, dp: bool) -> None:
    """train.overlap: each rank masks and sends its piece on its sync worker thread while it
    trains on (the ranks' seeds, with DP their norms, on the group's second gloo channel); every
    round merges both participants from ring values only, and every rank ends on the global rows."""
    rounds = 3
    privacy = {**SECAGG, "dp": True, "clip_norm": 1.0, "noise_multiplier": 0.01} if dp else SECAGG
    cfg = tiny_config(rounds=rounds, min_participants=2, outer={"algorithm": "fedavg"},
                      train={"sync_every": 3, "lr": 1e-2, "overlap": True}, privacy=privacy)
    out = tmp_path / "out"
    out.mkdir()
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        run_group_and_single(c, out)
        final = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        history = c.service.round_history(10)
        assert c.service.finished and c.service.status()["secure_aggregation"]["refused_attempts"] == 0
    params = sum(t.numel() for t in final.values())
    assert [rec["n_submissions"] for rec in history] == [2] * rounds
    for rec in history:  # ring values (2 bytes a parameter) and headers only
        assert 2 * 2 * params < rec["bytes_in"] < 2 * 2 * params + 16 * 4096, rec["bytes_in"]
    for pid in ("group", "single"):
        ended = local_model(out, pid, "final")
        assert all(torch.equal(ended[n], final[n]) for n in final), pid


@pytest.mark.slow  # (~40 s of process start-ups; the math is test_secagg_fsdp_rows.py's)
def test_with_distributed_dp_an_fsdp_group_clips_its_assembled_update(tmp_path: Path) -> None:
    """dp: true. Each round's merge is the plain mean of the updates clipped whole to C (the
    group's ranks sum their squared norms: a rank's rows are not clipped alone), plus noise: the
    merge's projection on that mean is 1 within the noise's share, and ε is reported."""
    pytest.importorskip("dp_accounting")
    rounds, clip = 2, 1.0
    cfg = tiny_config(rounds=rounds, min_participants=2, outer={"algorithm": "fedavg"},
                      train={"sync_every": 3, "lr": 1e-2},
                      privacy={**SECAGG, "dp": True, "clip_norm": clip, "noise_multiplier": 0.01})
    out = tmp_path / "out"
    out.mkdir()
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        run_group_and_single(c, out)
        final = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        history = c.service.round_history(10)[::-1]  # oldest first
        privacy = c.service.status()["privacy"]
    assert privacy["rounds"] == rounds and privacy["epsilon"] > 0
    for r, record in enumerate(history):
        start = local_model(out, "single", f"start{r}")
        merged = local_model(out, "single", f"start{r + 1}") if r + 1 < rounds else final
        names = sorted(start)

        def flat(model: dict[str, torch.Tensor], names: list[str] = names) -> torch.Tensor:
            return torch.cat([model[n].reshape(-1).double() for n in names])

        want = torch.zeros_like(flat(start))
        for s in record["submissions"]:
            delta = flat(start) - flat(local_model(out, s["participant_id"], f"round{r}"))
            assert float(delta.norm()) > 2 * clip  # the clip bites
            want += s["weight"] * delta * min(1.0, clip / float(delta.norm()))
        moved = flat(start) - flat(merged)
        coef = float(moved @ want) / float(want @ want)  # 1: clipped whole; per rank it would be larger
        assert abs(coef - 1) < 0.05, (r, coef)


@pytest.mark.slow  # (~35 s of process start-ups each)
@pytest.mark.parametrize("tau", [0, 1])
def test_an_fsdp_group_masks_streaming_fragments(tmp_path: Path, tau: int) -> None:
    """Streaming DiLoCo (K = 2, τ = 0 and 1) with secure aggregation: each round the group's ranks
    mask their rows of that round's fragment only (τ = 1: on the worker thread, one step before the
    round's end), and the rounds commit without a refused attempt."""
    cfg = tiny_config(rounds=4, min_participants=2, outer={"algorithm": "fedavg"},
                      train={"sync_every": 4, "lr": 1e-2}, model={"n_layer": 2},
                      streaming={"fragments": 2, "overlap": tau, "alpha": 0.0}, privacy=SECAGG)
    out = tmp_path / "out"
    out.mkdir()
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        run_group_and_single(c, out)
        history = c.service.round_history(10)[::-1]
        assert c.service.finished and c.service.status()["secure_aggregation"]["refused_attempts"] == 0
        params = sum(t.numel() for t in c.service.inspect().weights.values())
    sizes = [r["bytes_in"] for r in history]
    assert [r["n_submissions"] for r in history] == [2, 2, 2, 2]
    assert sizes[0] == sizes[2] and sizes[1] == sizes[3] and sizes[0] != sizes[1]  # fragment 0, 1, 0, 1
    assert sizes[0] + sizes[1] < 2 * 2 * params + 16 * 4096  # the two fragments: the model once, in the ring
