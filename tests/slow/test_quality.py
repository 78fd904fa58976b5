"""The learning-quality benchmark's --quick mode end to end: table and plot written, numbers sane."""

from __future__ import annotations

import functools
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"
UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def _rows(markdown: str) -> dict[str, dict[str, float]]:
    rows = {}
    for line in markdown.splitlines():
        m = re.match(r"\| `([\w.-]+)` \| [^|]+ \| ([\d.]+) \| [^|]+ \| ([\d.]+) M \| ([\d.]+) (\w+) \|", line)
        if m:
            name, loss, tokens, size, unit = m.groups()
            rows[name] = {"loss": float(loss), "tokens": float(tokens), "bytes": float(size) * UNITS[unit]}
    return rows


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quality_quick(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=540,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    png = tmp_path / "quality.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rows = _rows((tmp_path / "quality.md").read_text())
    assert {"dp", "diloco-h10", "diloco-h100", "fedavg-h100", "diloco-h50-iid", "diloco-h50-int8-ef"} <= set(rows)
    assert any(name.startswith("fedadam") for name in rows)
    # Every method saw the same tokens (but the lone participant: a quarter) and learned; the untrained
    # loss is about ln(256) = 5.5.
    assert len({row["tokens"] for name, row in rows.items() if name != "solo"}) == 1
    assert rows["solo"]["tokens"] == pytest.approx(rows["dp"]["tokens"] / 4, rel=0.05)
    for name, row in rows.items():
        assert math.isfinite(row["loss"]) and 1.0 < row["loss"] < 4.5, (name, row)
    # Bytes: DP all-reduces every step; fewer rounds send less; int8 uploads are ~4x smaller.
    assert rows["dp"]["bytes"] > 5 * rows["diloco-h10"]["bytes"]
    assert rows["diloco-h10"]["bytes"] > rows["diloco-h50"]["bytes"] > rows["diloco-h100"]["bytes"]
    assert rows["dp"]["bytes"] / rows["diloco-h100"]["bytes"] >= 50
    assert rows["diloco-h50-int8"]["bytes"] < 0.7 * rows["diloco-h50"]["bytes"]


# ---- the tokens20 study: Streaming DiLoCo in the simulation ------------------------------------

sys.path.insert(0, str(SCRIPT.parent))
TINY = dict(n_layer=2, n_embd=32, n_head=2, seq_len=16, batch_size=4, workers=2, steps=20, eval_every=10,
            eval_batches=2, eval_batch_size=4)


def test_streaming_k1_is_diloco() -> None:
    """Fast (default tier): K = 1, τ = 0, α = 0 is DiLoCo bit for bit, the end's flush against
    DiLoCo's last partial round included (the check raises AssertionError naming what differs)."""
    from quality_sim import Setup, check_stream_is_diloco

    assert "bit for bit" in check_stream_is_diloco(Setup(**TINY), h=6)


@pytest.mark.slow
def test_streaming_k1_is_diloco_at_m4() -> None:
    from quality_sim import Setup, check_stream_is_diloco

    assert "bit for bit" in check_stream_is_diloco(Setup(**{**TINY, "workers": 4}), h=4)


@pytest.mark.parametrize(("k", "split", "h", "tau", "alpha"), [
    (2, "strided", 6, 1, 0.5), (4, "sublayer", 8, 1, 0.5),
    pytest.param(2, "strided", 6, 2, 0.0, marks=pytest.mark.slow),
    pytest.param(4, "sublayer", 8, 0, 1.0, marks=pytest.mark.slow)])
def test_streaming_matches_reference(k: int, split: str, h: int, tau: int, alpha: float) -> None:
    """Fast: the benchmark's streaming run (fedtrain's merge: token-weighted `RunningSum`, one
    `OuterOptimizer` per fragment), ended as torchft ends, equals `fedtrain.streaming.simulate`
    (checked against torchft itself) bit for bit in every participant's and every global weight."""
    import torch
    from quality_sim import Log, Method, Setup, lr_at, new_model, run_stream, worker_streams

    from fedtrain.merge import build_torch_optimizer
    from fedtrain.streaming import simulate

    setup = Setup(**{**TINY, "steps": 21})
    method = Method("s", "main", kind="stream", sync_every=h, fragments=k, fragment_split=split, overlap=tau,
                    alpha=alpha, outer_lr=0.7)
    ours = run_stream(setup, method, Log("s", quiet=True), flush=False)

    class Inner(torch.optim.AdamW):  # inner_step's AdamW: the study's lr schedule, then clipping
        def __init__(self, params: list) -> None:
            super().__init__(params, lr=setup.lr, weight_decay=0.0)
            self.clipped, self.t = params, 0

        def step(self, closure=None):  # type: ignore[no-untyped-def, override]
            for group in self.param_groups:
                group["lr"] = lr_at(setup, self.t)
            torch.nn.utils.clip_grad_norm_(self.clipped, setup.grad_clip)
            self.t += 1
            return super().step(closure)

    streams = worker_streams(setup, "noniid")
    batches = [[s.next_batch() for _ in range(setup.steps)] for s in streams]
    ref = simulate(lambda: new_model(setup)[0], lambda r, t: batches[r][t], lambda m, b: m(*b)[1], Inner,
                   replicas=setup.workers, steps=setup.steps, h=h, fragment_names=_fragments(method, setup),
                   tau=tau, alpha=alpha, outer=lambda ps: build_torch_optimizer(ps, "diloco", method.outer_hp()))
    assert ours["rounds"] == sum(1 for _, what, _ in ref.events if what == "apply") > k
    for name, value in ref.global_weights.items():
        assert torch.equal(value, ours["_params"][name]), name
    for r, local in enumerate(ref.local):
        for name, value in local.items():
            assert torch.equal(value, ours["_local"][r][name]), (r, name)


def _fragments(method, setup):  # type: ignore[no-untyped-def]
    from quality_sim import new_model, study_fragments

    return study_fragments([n for n, _ in new_model(setup)[0].named_parameters()], method)


def test_sublayer_fragments() -> None:
    """K = 4 over the built-in GPT's 2 blocks: attention and MLP halves, embeddings first, ln_f last."""
    from quality_sim import Method, Setup, new_model, study_fragments

    names = [n for n, _ in new_model(Setup(**TINY))[0].named_parameters()]
    frags = study_fragments(names, Method("s", "main", kind="stream", fragments=4, fragment_split="sublayer"))
    assert frags[0][:2] == ["wte.weight", "wpe.weight"] and frags[3][-2:] == ["ln_f.weight", "ln_f.bias"]
    assert all(n.startswith(("blocks.0.ln_1", "blocks.0.attn")) for n in frags[0][2:])
    assert all(n.startswith(("blocks.0.ln_2", "blocks.0.mlp")) for n in frags[1])
    assert all(n.startswith(("blocks.1.ln_1", "blocks.1.attn")) for n in frags[2])
    assert sorted(n for f in frags for n in f) == sorted(names)


TOKENS20_QUICK = ["m2-dp", "m2-diloco-h30", "m2-stream-h30-k2-t1", "m2-stream-h32-k4-t5", "m4-dp", "m4-diloco-h30",
                  "m4-stream-h30-k2-t5", "m2-short-dp", "m2-short-diloco-h10-lr0.1", "m2-short-diloco-h10-lr0.4"]


def _rows20(markdown: str) -> dict[str, list[str]]:
    """The tokens20 tables' rows by run name: the cells after the name."""
    rows = {}
    for line in markdown.splitlines():
        m = re.match(r"\| `([\w.-]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = m.group(2).split(" | ")
    return rows


def _size(cell: str) -> float:
    size, unit = cell.split()
    return float(size) * UNITS[unit]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quality_tokens20_quick(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--study", "tokens20", "--quick", "--out-dir", str(tmp_path),
         "--cache", str(tmp_path / "cache"), "--only", *TOKENS20_QUICK],
        capture_output=True, text=True, timeout=540,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "streaming K=1 τ=0 α=0 equals DiLoCo bit for bit" in r.stderr
    assert (tmp_path / "quality-tokens20.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list((tmp_path / "cache").glob("*.json"))) == len(TOKENS20_QUICK)
    rows = _rows20((tmp_path / "quality.md").read_text())
    assert set(TOKENS20_QUICK) <= set(rows)
    # cells: M, method, loss, vs DP, tokens, bytes, fewer than DP, peak per sync, peak vs DiLoCo, syncs, wall
    assert {rows[n][0] for n in TOKENS20_QUICK} == {"2", "4"}
    main = [n for n in TOKENS20_QUICK if "short" not in n]
    assert len({rows[n][4] for n in main}) == 1  # one token budget at both M
    for name in TOKENS20_QUICK:
        assert math.isfinite(float(rows[name][2])) and 1.0 < float(rows[name][2]) < 4.5, (name, rows[name])
    for m in (2, 4):
        assert rows[f"m{m}-dp"][3] == "+0.00%" and rows[f"m{m}-diloco-h30"][8] == "1.00×"
    # Streaming sends one fragment per sync: a smaller peak than DiLoCo's, smaller still at K = 4.
    k2, k4 = (float(rows[n][8].rstrip("×")) for n in ("m2-stream-h30-k2-t1", "m2-stream-h32-k4-t5"))
    assert 0.4 < k2 < 0.75 and 0.2 < k4 < k2
    assert _size(rows["m2-stream-h30-k2-t1"][7]) < _size(rows["m2-diloco-h30"][7])
    assert int(rows["m2-stream-h30-k2-t1"][9]) > 1.9 * int(rows["m2-diloco-h30"][9])


# ---- the compress20 and dp20 studies: compressed links and central DP in the simulation ------


def _fed(**kw):  # type: ignore[no-untyped-def]
    from quality_sim import Log, Method, Setup, run_fed

    method = Method("f", "main", sync_every=6, outer_lr=0.7, **kw)
    return run_fed(Setup(**{**TINY, "steps": 18}), method, Log("f", quiet=True))


@functools.cache
def _plain():  # type: ignore[no-untyped-def]
    """The plain run the fast tests compare with (read only: run once per session)."""
    return _fed()


def test_downlink_error_feedback_sums_to_the_target() -> None:
    """Fast: the coordinator's side of compressed downloads. After each publish P + E is the
    outer step's result G plus the residual before it (nothing is lost, only delayed), the outer
    step's weights are set to P, and the body is far smaller than the whole model's."""
    import torch
    from quality_compress import Downlink, full_body_bytes

    from fedtrain.wire.compress import Codec

    codec = Codec("topk", k=41, chunk=4096, bits=2)
    gen = torch.Generator().manual_seed(1)
    start = {"w": torch.randn(300, 70, generator=gen), "b": torch.randn(70, generator=gen)}
    link = Downlink(codec, start)
    target = {n: t.clone() for n, t in start.items()}
    for _ in range(5):
        before = {n: link.residual.get(n, torch.zeros_like(t)).clone() for n, t in target.items()}
        for t in target.values():
            t.add_(torch.randn(t.shape, generator=gen), alpha=0.1)
        goal = {n: t.clone() for n, t in target.items()}
        nbytes = link.publish(target)
        assert nbytes * 40 < full_body_bytes(target, 1)
        for n in target:
            assert torch.equal(target[n], link.published[n])
            torch.testing.assert_close(link.published[n] + link.residual[n], goal[n] + before[n], rtol=0, atol=1e-5)
        assert sum(float(e.abs().sum()) for e in link.residual.values()) > 0


def test_uncompressed_downloads_through_the_downlink_match_the_plain_run() -> None:
    """Fast: the compressed-download path with codec "none" (P += G − P, no residual) gives the
    plain run's upload bytes and download sizes, its weights within 1e-5 and its held-out loss
    within 1e-5 relative. Not bit for bit: P + (G − P) is G only up to one rounding of the
    difference (Sterbenz's lemma does not cover values that cross zero); 3 rounds of training
    grew that to 2.2e-6 at most when this was written."""
    import torch

    plain, through = _plain(), _fed(download=True)
    assert through["bytes_up"] == plain["bytes_up"] and through["rounds"] == plain["rounds"] == 3
    assert through["bytes_down"] < plain["bytes_down"] * 1.01  # a body of Δ, not the versioned model
    for name, value in plain["_params"].items():
        torch.testing.assert_close(through["_params"][name], value, rtol=0, atol=1e-5)
    assert through["curve"][-1][1] == pytest.approx(plain["curve"][-1][1], rel=1e-5)


def test_compressed_links_keep_every_copy_identical() -> None:
    """Fast: topk 1% 2-bit both ways, error feedback on both sides: the outer step's weights are
    the published model bit for bit at the end (every participant starts each round from them),
    both directions send over 10x fewer bytes than fp32 (the tiny model's headers weigh), and the
    model still learns."""
    import torch

    plain = _plain()
    run = _fed(compression="topk", density=0.01, bits=2, error_feedback=True, download=True)
    published = run["_published"].published
    for name, value in run["_params"].items():
        assert torch.equal(value, published[name]), name
    assert run["bytes_up"] * 10 < plain["bytes_up"] and run["bytes_down"] * 10 < plain["bytes_down"]
    assert run["curve"][-1][1] < run["curve"][0][1]
    assert run["bytes_initial"] == plain["bytes_initial"] > 0


@pytest.mark.slow
def test_central_dp_in_the_study() -> None:
    """Slow (three runs): a clip no Δ reaches is the plain run bit for bit (factor 1.0, no noise); a tiny C clips
    every Δ, and ε is dp-accounting's for the rounds merged, as the coordinator's `CentralDp`
    reports it."""
    import torch

    from fedtrain.config.privacy import PrivacyConfig
    from fedtrain.privacy.central import CentralDp

    plain, loose = _plain(), _fed(clip=1e9)
    for name, value in plain["_params"].items():
        assert torch.equal(loose["_params"][name], value), name
    assert loose["clipped_share"] == 0 and "epsilon_pld" not in loose
    noisy = _fed(clip=0.05, noise=0.5)
    assert noisy["clipped_share"] == 1.0 and noisy["dp_rounds"] == 3
    assert noisy["delta_norms"]["median"] > 0.05
    expect = CentralDp(PrivacyConfig(clip_norm=0.05, noise_multiplier=0.5, accountant="pld"), 3, 3).epsilon
    assert noisy["epsilon_pld"] == pytest.approx(expect) and 0 < expect < math.inf


def test_central_dp_noise_on_the_mean() -> None:
    """Fast: the noise lands on the mean, N(0, (σ·w_max·C)²) per coordinate (4 equal shares: w_max
    = 1/4), and clipping bounds each Δ to C."""
    import torch
    from quality_compress import Privacy

    dp = Privacy(clip=2.0, noise=3.0, planned_rounds=10)
    big = {"w": torch.full((100, 100), 1.0)}
    assert torch.linalg.vector_norm(dp.clip_delta(big)["w"]).item() == pytest.approx(2.0, rel=1e-5)
    mean = {"w": torch.zeros(200, 500)}
    dp.noise_mean(mean, {str(i): 0.25 for i in range(4)})
    assert float(mean["w"].mean()) == pytest.approx(0.0, abs=0.02)
    assert float(mean["w"].std()) == pytest.approx(3.0 * 0.25 * 2.0, rel=0.02)
    assert dp.result()["dp_rounds"] == 1 and dp.result()["clipped_share"] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quality_compress20_and_dp20_quick(tmp_path: Path) -> None:
    """Both new studies end to end at --quick size (a subset of compress20): the tables, the goal
    lines, the plots; compressed downloads cut the bytes down, topk both ways the bytes in all."""
    pytest.importorskip("matplotlib")
    cache = tmp_path / "cache"
    runs = ["m2-dp", "m2-diloco-h30", "m2-topk1-both", "m2-topk1-up", "m2-int8-both", "m2-stream-k2-topk3-fedavg-up"]
    for study, only in (("compress20", runs), ("dp20", [])):
        r = subprocess.run([sys.executable, str(SCRIPT), "--study", study, "--quick", "--out-dir", str(tmp_path),
                            "--cache", str(cache), *(["--only", *only] if only else [])],
                           capture_output=True, text=True, timeout=540)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (tmp_path / f"quality-{study}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "quality.md").read_text()
    assert "Goal (issue #32)" in text and "quality-compress20:end" in text and "quality-dp20:end" in text
    rows = _rows20(text)
    # compress20 cells: M, method, loss, vs DP, vs fp32, up, down, all, fewer than DP, peak, syncs, wall
    assert rows["m2-diloco-h30"][4] == "+0.00%" and rows["m2-dp"][3] == "+0.00%"
    assert _size(rows["m2-topk1-both"][6]) * 3 < _size(rows["m2-topk1-up"][6])
    assert _size(rows["m2-topk1-both"][7]) * 5 < _size(rows["m2-diloco-h30"][7])
    assert _size(rows["m2-topk1-up"][5]) * 20 < _size(rows["m2-diloco-h30"][5])
    # Relayed: the -up run's loss and uploads; down the other's uploads (M = 2: as many as up) and the
    # first whole model, instead of a model every round.
    relay, up = rows["m2-topk1-relay"], rows["m2-topk1-up"]
    assert relay[2] == up[2] and relay[5] == up[5]
    assert _size(relay[5]) < _size(relay[6]) < _size(up[6]) / 3
    assert _size(rows["m2-stream-k2-topk3-fedavg-relay"][7]) * 3 < _size(rows["m2-stream-k2-topk3-fedavg-up"][7])
    for name in [*runs, "m4-diloco-h30-dp0.1"]:
        assert 1.0 < float(rows[name][2 if name.startswith("m2") else 4]) < 6.0, (name, rows[name])
