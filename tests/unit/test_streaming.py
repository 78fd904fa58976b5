"""Streaming DiLoCo's pure parts: fragment assignment, the schedule against torchft's step hook,
and the reference simulator against plain DiLoCo as fedtrain's merge computes it.

The comparison with torchft itself is `benchmarks/streaming_compare.py` (slow:
tests/slow/test_streaming_torchft.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fedtrain.config import ModelConfig, RunConfig, outer_defaults
from fedtrain.errors import ConfigError
from fedtrain.merge import OuterOptimizer, RunningSum, build_torch_optimizer, pseudo_gradient
from fedtrain.recipes.gpt import build_model
from fedtrain.streaming import StepEvents, check_schedule, fragments, schedule, simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from streaming_net import Net, mse  # the model streaming_compare.py runs against torchft

WIDTH = 6  # narrower than the benchmark's: the simulations here run in a few ms

# --------------------------------------------------------------------------- a small seeded problem


def build() -> Net:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Net(width=WIDTH)


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(5, 3, generator=g) + replica  # each replica its own data
    return x, torch.stack([x.sum(1).sin(), x[:, 0] * x[:, 1]], 1)


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


NAMES = [n for n, _ in Net().named_parameters()]

# --------------------------------------------------------------------------- fragments


def test_strided_fragments_of_the_builtin_gpt() -> None:
    model = build_model(ModelConfig(n_layer=4, n_head=2, n_embd=16, block_size=16))
    names = [n for n, _ in model.named_parameters()]
    frags = fragments(names, 2)
    assert sorted(frags[0] + frags[1]) == sorted(names)
    blocks_of = [sorted({n.split(".")[1] for n in f if n.startswith("blocks.")}) for f in frags]
    assert blocks_of == [["0", "2"], ["1", "3"]]
    assert {"wte.weight", "wpe.weight"} <= set(frags[0])  # before block 0 (the tied head is wte)
    assert {"ln_f.weight", "ln_f.bias"} <= set(frags[1])  # after the last block, which is in fragment 1
    assert all(f == [n for n in names if n in f] for f in frags)  # each in the model's order


def test_strided_sequential_and_one_fragment() -> None:
    strided = fragments(NAMES, 4)
    assert strided[0] == ["embed.weight", "embed.bias", "blocks.0.weight", "blocks.0.bias"]
    assert strided[3] == ["blocks.3.weight", "blocks.3.bias", "head.weight", "head.bias"]
    seq = fragments(NAMES, 2, "sequential")
    assert seq == [NAMES[:6], NAMES[6:]]
    assert fragments(NAMES, 1) == [NAMES]


def test_strided_with_more_blocks_than_fragments() -> None:
    names = [n for n, _ in Net(blocks=5).named_parameters()]
    frags = fragments(names, 2)
    assert [n for n in frags[0] if n.startswith("blocks.")] == [
        "blocks.0.weight", "blocks.0.bias", "blocks.2.weight", "blocks.2.bias", "blocks.4.weight", "blocks.4.bias"]
    assert frags[0][-2:] == ["head.weight", "head.bias"]  # the last block (4) is in fragment 0


def test_block_pattern_finds_hf_layer_names() -> None:
    names = ["model.embed_tokens.weight", *(f"model.layers.{i}.mlp.weight" for i in range(4)), "model.norm.weight",
             "lm_head.weight"]
    assert fragments(names, 2) == [[*names[:2], names[3]], [names[2], names[4], names[5], names[6]]]


def test_name_patterns() -> None:
    frags = fragments(NAMES, 2, [["embed.*", "blocks.0.*", "blocks.1.*"], ["blocks.[23].*", "head.*"]])
    assert frags == [NAMES[:6], NAMES[6:]]


@pytest.mark.parametrize(("patterns", "words"), [
    ([["embed.*", "blocks.*"], ["blocks.3.*"]], "matched by fragments 0, 1"),
    ([["embed.*", "blocks.*"], ["nothing.*"]], "matches no parameter"),
    ([["embed.*"], ["blocks.*"]], "no fragment's patterns match head.weight, head.bias"),
    ([["*"]], "1 pattern lists were given for 2 fragments"),
    (["embed.*", "blocks.*"], "not one string"),
])
def test_name_patterns_that_do_not_partition(patterns: list, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        fragments(NAMES, 2, patterns)


@pytest.mark.parametrize(("names", "k", "strategy", "words"), [
    (NAMES, 5, "strided", "5 fragments need at least 5 blocks"),
    (["a.weight", "b.weight"], 2, "strided", "no parameter name matches the block pattern"),
    (NAMES, 2, "zigzag", "unknown fragment strategy"),
    (NAMES, 0, "strided", "whole number"),
    ([*NAMES, "head.bias"], 2, "strided", "repeat: head.bias"),
    ([], 1, "strided", "empty"),
])
def test_fragments_refuse(names: list[str], k: int, strategy: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        fragments(names, k, strategy)


# --------------------------------------------------------------------------- schedule


def torchft_hook_events(steps: int, h: int, k: int, tau: int) -> list[StepEvents]:
    """torchft 0.2.0's `DiLoCo._step_post_hook`, transcribed with a manager that always commits:
    its counter, the fragment `current_step() % K`, prepare at S − τ and perform at S."""
    s, local_step, committed, out = h // k, 0, 0, []
    for _ in range(steps):
        local_step += 1
        send = apply = None
        if local_step == s - tau:
            send = committed % k
        if local_step == s:
            apply = committed % k
            committed += 1  # should_commit() in perform_sync
            local_step = 0
        out.append(StepEvents(send=send, apply=apply))
    return out


@pytest.mark.parametrize(("h", "k", "tau"), [(1, 1, 0), (4, 1, 0), (4, 1, 3), (8, 2, 0), (8, 2, 3), (8, 4, 1),
                                             (12, 3, 2), (12, 4, 2), (6, 6, 0)])
def test_schedule_is_torchfts_hook(h: int, k: int, tau: int) -> None:
    steps = 3 * h + 5
    assert [schedule(t, h, k, tau) for t in range(1, steps + 1)] == torchft_hook_events(steps, h, k, tau)


def test_schedule_plain_diloco_and_a_round_robin() -> None:
    plain = {t: schedule(t, 5, 1, 0) for t in range(1, 16)}
    assert {t for t, e in plain.items() if e != StepEvents()} == {5, 10, 15}
    assert plain[10] == StepEvents(send=0, apply=0)
    rr = [(t, e.send, e.apply) for t in range(1, 11) if (e := schedule(t, 8, 4, 1)) != StepEvents()]
    assert rr == [(1, 0, None), (2, None, 0), (3, 1, None), (4, None, 1), (5, 2, None), (6, None, 2),
                  (7, 3, None), (8, None, 3), (9, 0, None), (10, None, 0)]


@pytest.mark.parametrize(("h", "k", "tau", "words"), [
    (6, 4, 0, "multiple of the number of fragments"),
    (8, 4, 2, "0 ≤ τ < H/K = 2"),
    (8, 2, -1, "0 ≤ τ"),
    (0, 1, 0, "H must be a whole number"),
    (3, 6, 0, "multiple"),
])
def test_schedule_refuses(h: int, k: int, tau: int, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        check_schedule(h, k, tau)


def test_steps_count_from_one() -> None:
    with pytest.raises(ConfigError, match="count from 1"):
        schedule(0, 4, 1, 0)


# --------------------------------------------------------------------------- simulator


def fedtrain_plain_diloco(replicas: int, rounds: int, h: int) -> tuple[list[dict[str, torch.Tensor]], OuterOptimizer]:
    """Plain DiLoCo as fedtrain's merge computes it: H inner steps per replica, Δᵢ = θ_r − θᵢ
    folded into a RunningSum (equal token counts), the coordinator's outer Nesterov step, and
    every replica loads θ_{r+1}."""
    models = [build() for _ in range(replicas)]
    inners = [adamw(list(m.parameters())) for m in models]
    outer = OuterOptimizer(dict(models[0].named_parameters()), "diloco", outer_defaults(RunConfig()))
    for rnd in range(rounds):
        for t in range(h):
            for r, m in enumerate(models):
                inners[r].zero_grad()
                mse(m, batch(r, rnd * h + t)).backward()
                inners[r].step()
        acc = RunningSum(outer.params)
        for m in models:
            acc.add(pseudo_gradient(outer.params, dict(m.named_parameters())), weight=640)
        outer.step(*acc.scaled())
        with torch.no_grad():
            for m in models:
                for name, p in m.named_parameters():
                    p.copy_(outer.params[name])
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models], outer


def test_one_fragment_no_overlap_no_mixing_is_fedtrains_plain_diloco() -> None:
    """fedtrain's outer step is its own torch optimizer (`build_torch_optimizer`: fused SGD where
    torch has the kernel, which rounds the last elements of a tensor, past its last full
    vector, differently from torch's default SGD): the simulator is given that one, so what is
    compared is the rest, schedule, pseudo-gradients, mean and apply, bit for bit."""
    ours, outer = fedtrain_plain_diloco(replicas=2, rounds=3, h=4)
    hp = outer_defaults(RunConfig())
    sim = simulate(build, batch, mse, adamw, replicas=2, steps=12, h=4, fragment_names=[NAMES],
                   outer=lambda ps: build_torch_optimizer(ps, "diloco", hp))
    assert [e for e in sim.events if e[1] == "apply"] == [(4, "apply", 0), (8, "apply", 0), (12, "apply", 0)]
    for r in range(2):
        for name in NAMES:
            assert torch.equal(sim.local[r][name], ours[r][name]), (r, name)
    for name in NAMES:
        assert torch.equal(sim.global_weights[name], outer.params[name]), name


def test_alpha_one_leaves_the_local_weights_alone() -> None:
    """α = 1 keeps θ_local at every apply, so the replicas train as if alone; θ_g still moves."""
    alone = simulate(build, batch, mse, adamw, replicas=2, steps=8, h=9, fragment_names=[NAMES])  # no sync yet
    sim = simulate(build, batch, mse, adamw, replicas=2, steps=8, h=4, tau=1, alpha=1.0,
                   fragment_names=fragments(NAMES, 2))
    assert [e for e in sim.events if e[1] == "apply"] == [(2, "apply", 0), (4, "apply", 1), (6, "apply", 0),
                                                          (8, "apply", 1)]
    for r in range(2):
        for name in NAMES:
            assert torch.equal(sim.local[r][name], alone.local[r][name]), (r, name)
    assert not torch.equal(sim.global_weights["head.weight"], build().head.weight)


def test_alpha_zero_takes_the_global_fragment_and_keeps_the_others_local() -> None:
    frags = fragments(NAMES, 2)
    sim = simulate(build, batch, mse, adamw, replicas=2, steps=6, h=4, tau=1, fragment_names=frags)
    assert sim.events[-1] == (6, "apply", 0)
    for r in range(2):
        for name in frags[0]:  # just applied with α = 0: exactly θ_g on every replica
            assert torch.equal(sim.local[r][name], sim.global_weights[name])
    for name in frags[1]:  # trained 2 steps since its apply at step 4, on different data
        assert not torch.equal(sim.local[0][name], sim.local[1][name])
    assert [len(o.state) for o in sim.outer] == [len(frags[0]), len(frags[1])]  # momentum per fragment


def test_a_fragment_in_flight_at_the_end_is_dropped() -> None:
    frags = fragments(NAMES, 2)
    four = simulate(build, batch, mse, adamw, replicas=2, steps=4, h=4, tau=1, fragment_names=frags)
    five = simulate(build, batch, mse, adamw, replicas=2, steps=5, h=4, tau=1, fragment_names=frags)
    assert five.events[-1] == (5, "send", 0)
    for name in NAMES:
        assert torch.equal(five.global_weights[name], four.global_weights[name]), name


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"fragment_names": [NAMES[:2], NAMES[1:3]]}, "already in an earlier fragment"),
    ({"fragment_names": [["nope"]]}, "no such parameter"),
    ({"fragment_names": [NAMES], "alpha": 1.5}, "within"),
    ({"fragment_names": [NAMES], "h": 3, "tau": 3}, "0 ≤ τ"),
])
def test_simulate_refuses(kwargs: dict, words: str) -> None:
    args = {"replicas": 2, "steps": 2, "h": 2, **kwargs}
    with pytest.raises(ConfigError, match=words):
        simulate(build, batch, mse, adamw, **args)


def test_replicas_must_start_alike() -> None:
    with pytest.raises(ConfigError, match="same weights"):
        simulate(lambda: Net(width=WIDTH), batch, mse, adamw, replicas=2, steps=1, h=1, fragment_names=[NAMES])
