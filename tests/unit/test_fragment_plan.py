"""The coordinator's Streaming DiLoCo plan (`coordinator/fragments.py`): round r syncs
fragment r mod K, the fragments come from the config and the model's tensor order, an
assignment that does not fit is a ConfigError naming why, and a body with another
fragment's tensors is a 400 naming the round's fragment."""

from __future__ import annotations

import pytest

from fedtrain.config import RunConfig
from fedtrain.coordinator.rounds.fragment_plan import FragmentPlan, check_fragment, plan_for
from fedtrain.errors import ConfigError, Refused
from fedtrain.streaming import fragments
from fedtrain.wire.compress import SCALE_SUFFIX

NAMES = ["wte.weight", "wpe.weight", *(f"blocks.{i}.{p}" for i in range(4) for p in ("w", "b")), "ln_f.weight"]


def config(**streaming: object) -> RunConfig:
    return RunConfig.model_validate({"train": {"sync_every": 4}, "streaming": {"overlap": 0, **streaming}})


def test_round_r_syncs_fragment_r_mod_k() -> None:
    plan = plan_for(config(fragments=2), NAMES)
    assert plan is not None and plan.k == 2
    assert plan.names[0] == ("wte.weight", "wpe.weight", "blocks.0.w", "blocks.0.b", "blocks.2.w", "blocks.2.b")
    assert plan.names[1] == ("blocks.1.w", "blocks.1.b", "blocks.3.w", "blocks.3.b", "ln_f.weight")
    assert [plan.of(r) for r in range(5)] == [0, 1, 0, 1, 0]
    f = plan.fragment(7)
    assert (f.round, f.index, f.k, f.names) == (7, 1, 2, plan.names[1])
    assert plan.view() == {"fragments": [list(plan.names[0]), list(plan.names[1])], "k": 2}
    assert plan_for(RunConfig(), NAMES) is None  # streaming off


def test_sequential_and_patterns_come_from_the_config() -> None:
    seq = plan_for(config(fragments=2, assign="sequential"), NAMES)
    assert seq is not None and seq.names[0][-1] == "blocks.1.b"
    pats = plan_for(config(fragments=2, assign=[["w*", "blocks.[01].*"], ["blocks.[23].*", "ln_f.*"]]), NAMES)
    assert pats is not None and pats.names == FragmentPlan((tuple(NAMES[:6]), tuple(NAMES[6:]))).names


@pytest.mark.parametrize(("streaming", "words"), [
    ({"fragments": 8, "assign": "strided"}, "8 fragments need at least 8 blocks, and the model has 4"),
    ({"fragments": 2, "assign": [["w*"], ["nothing.*"]]}, "pattern 'nothing.*' of fragment 1 matches no parameter"),
])
def test_an_assignment_that_does_not_fit_is_a_config_error(streaming: dict, words: str) -> None:
    cfg = RunConfig.model_validate({"train": {"sync_every": 8}, "streaming": {"overlap": 0, **streaming}})
    with pytest.raises(ConfigError, match=words.replace("*", r"\*").replace(".", r"\.")) as e:
        plan_for(cfg, NAMES)
    assert e.value.message.startswith(f"streaming: the model's {len(NAMES)} tensors cannot be split into")


def test_blocks_sort_by_their_number_when_the_names_come_sorted_as_strings() -> None:
    natural = [f"blocks.{i}.w" for i in range(12)]
    as_strings = sorted(natural)  # blocks.0, blocks.1, blocks.10, blocks.11, blocks.2, ...
    assert as_strings[2] == "blocks.10.w"
    def by_block(frags: list[list[str]]) -> list[set[str]]:  # (each fragment lists its names in the given order)
        return [set(f) for f in frags]

    want = [{f"blocks.{i}.w" for i in range(p, 12, 4)} for p in range(4)]
    assert by_block(fragments(as_strings, 4)) == want == by_block(fragments(natural, 4))
    assert by_block(fragments(as_strings, 2, "sequential")) == [set(natural[:6]), set(natural[6:])]


def test_a_body_of_another_fragment_is_refused_with_the_rounds_fragment() -> None:
    plan = plan_for(config(fragments=2), NAMES)
    assert plan is not None
    model = dict.fromkeys(NAMES)
    f = plan.fragment(2)  # fragment 0
    check_fragment(f, model, list(f.names), whole=True)
    check_fragment(f, model, [n + SCALE_SUFFIX if i % 2 else n for i, n in enumerate(f.names)] + list(f.names),
                   whole=True)  # an int8 body: its scales go with their tensors
    check_fragment(f, model, ["ghost.weight"], whole=True)  # a tensor the model lacks: the model check's (422)
    check_fragment(f, model, list(f.names[:2]), whole=False)  # a piece holds some of them
    with pytest.raises(Refused) as e:
        check_fragment(f, model, list(plan.names[1]), whole=True)
    err = e.value
    assert (err.status, err.code) == (400, "wrong_fragment")
    assert err.message.startswith("round 2 syncs fragment 0 of 2 (6 tensors)")
    assert err.details["missing"] == list(f.names) and err.details["unexpected"] == list(plan.names[1])
    with pytest.raises(Refused, match="not in fragment 0: ln_f.weight") as e:
        check_fragment(f, model, ["ln_f.weight"], whole=False)
    assert e.value.details["missing"] == []
