"""The outer step over a fragment of the parameters (Streaming DiLoCo): one `OuterOptimizer`
stepped fragment by fragment is one torch optimizer per fragment, bit for bit; the other
parameters and their state stay as they are; and its state, saved after some fragments
only, restores and goes on as if it had never stopped."""

from __future__ import annotations

import pytest
import torch

from fedtrain.errors import MergeError
from fedtrain.merge import OuterOptimizer, build_torch_optimizer
from fedtrain.merge.outer import PARTIAL_KEY
from tests.helpers.merge import hp_for, roundtrip

SHAPES = {"embed.weight": (5, 3), "blocks.0.weight": (3, 3), "blocks.0.bias": (3,), "blocks.1.weight": (3, 3),
          "blocks.1.bias": (3,), "head.weight": (2, 3)}
FRAGMENTS = [["embed.weight", "blocks.0.weight", "blocks.0.bias"], ["blocks.1.weight", "blocks.1.bias", "head.weight"]]
ORDER = [0, 1, 0, 1, 0]  # round r syncs fragment r mod 2


def start() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def deltas() -> list[dict[str, torch.Tensor]]:
    """Round r's mean Δ, over fragment ORDER[r]'s tensors only."""
    gen = torch.Generator().manual_seed(4)
    return [{n: 0.1 * torch.randn(SHAPES[n], generator=gen) for n in FRAGMENTS[p]} for p in ORDER]


def copy(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in d.items()}


@pytest.mark.parametrize("algorithm", ["diloco", "fedadam", "fedyogi"])
def test_stepping_fragment_by_fragment_is_one_torch_optimizer_per_fragment(algorithm: str) -> None:
    hp = hp_for(algorithm)
    outer = OuterOptimizer(start(), algorithm, hp)
    # the reference: each fragment its own parameters and its own torch optimizer
    ref = [{n: start()[n].clone() for n in names} for names in FRAGMENTS]
    opts = [build_torch_optimizer(list(r.values()), algorithm, hp) for r in ref]
    for d, p in zip(deltas(), ORDER, strict=True):
        before = {n: t.clone() for n, t in outer.params.items()}
        state_before = {k: v.clone() for k, v in outer.state_tensors().items()}
        outer.step(copy(d), names=FRAGMENTS[p])
        for name, t in ref[p].items():
            t.grad = d[name].clone()
        opts[p].step()
        for t in ref[p].values():
            t.grad = None
        for q, names in enumerate(FRAGMENTS):
            for n in names:
                assert torch.equal(outer.params[n], ref[q][n]), (p, n)
        for n in FRAGMENTS[1 - p]:  # the other fragment: weights and state untouched
            assert torch.equal(outer.params[n], before[n]), n
            for key, value in outer.state_tensors().items():
                if key.endswith("/" + n):
                    assert torch.equal(value, state_before[key]), key
    for q, names in enumerate(FRAGMENTS):  # each fragment's state is its own optimizer's
        for n in names:
            mine = {k.split("/")[0]: v for k, v in outer.state_tensors().items() if k.endswith("/" + n)}
            theirs = opts[q].state[ref[q][n]]
            assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine), n
    assert outer.steps == len(ORDER) and outer.partial


def test_the_first_fragments_step_leaves_the_others_without_state() -> None:
    outer = OuterOptimizer(start(), "diloco", hp_for("diloco"))
    first = start()
    outer.step(copy(deltas()[0]), names=FRAGMENTS[0])
    assert {k.split("/")[1] for k in outer.state_tensors()} == set(FRAGMENTS[0])
    assert all(torch.equal(outer.params[n], first[n]) for n in FRAGMENTS[1])
    assert outer.state_metadata()[PARTIAL_KEY] == "1"


@pytest.mark.parametrize("algorithm", ["diloco", "fedadam"])
def test_state_saved_between_fragments_restores_and_goes_on_bitwise(algorithm: str) -> None:
    hp = hp_for(algorithm)
    straight = OuterOptimizer(start(), algorithm, hp)
    for d, p in zip(deltas(), ORDER, strict=True):
        straight.step(copy(d), names=FRAGMENTS[p])
    stopped = OuterOptimizer(start(), algorithm, hp)
    stopped.step(copy(deltas()[0]), names=FRAGMENTS[0])  # fragment 1 holds no state yet
    resumed = roundtrip(stopped)
    assert resumed.partial and resumed.steps == 1
    for d, p in list(zip(deltas(), ORDER, strict=True))[1:]:
        resumed.step(copy(d), names=FRAGMENTS[p])
    for n in SHAPES:
        assert torch.equal(resumed.params[n], straight.params[n]), n
    a, b = resumed.state_tensors(), straight.state_tensors()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_partial_state_with_a_tensor_missing_is_refused() -> None:
    outer = OuterOptimizer(start(), "fedadam", hp_for("fedadam"))
    outer.step(copy(deltas()[0]), names=FRAGMENTS[0])
    tensors = dict(outer.state_tensors())
    del tensors["exp_avg/blocks.0.bias"]
    with pytest.raises(MergeError, match="missing exp_avg/blocks.0.bias"):
        OuterOptimizer.restore(outer.params, tensors, outer.state_metadata())
    # without the partial flag, a parameter without state after a step is refused as before
    meta = {k: v for k, v in outer.state_metadata().items() if k != PARTIAL_KEY}
    with pytest.raises(MergeError, match="should hold"):
        OuterOptimizer.restore(outer.params, outer.state_tensors(), meta)


def test_a_fragment_step_checks_its_tensors_and_a_whole_step_still_needs_them_all() -> None:
    outer = OuterOptimizer(start(), "diloco", hp_for("diloco"))
    frag = copy(deltas()[0])
    with pytest.raises(MergeError, match="missing keys: blocks.1.weight"):  # not asked for a subset
        outer.step({k: v for k, v in frag.items()})
    with pytest.raises(MergeError, match="missing keys: blocks.0.bias"):
        outer.step({k: v for k, v in frag.items() if k != "blocks.0.bias"}, names=FRAGMENTS[0])
    with pytest.raises(MergeError, match="unexpected keys: head.weight"):
        outer.step({**frag, "head.weight": torch.zeros(2, 3)}, names=FRAGMENTS[0])
    with pytest.raises(MergeError, match="does not have: ghost"):
        outer.step(frag, names=[*FRAGMENTS[0], "ghost"])
    assert outer.steps == 0 and outer.state_tensors() == {} and not outer.partial
    whole = OuterOptimizer(start(), "diloco", hp_for("diloco"))
    whole.step({n: torch.ones(s) for n, s in SHAPES.items()}, names=list(SHAPES))  # every name: not partial
    assert not whole.partial and PARTIAL_KEY not in whole.state_metadata()
