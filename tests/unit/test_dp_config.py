"""Central DP's config rules (`config/privacy.py`): each composition it cannot honour is refused
with its reason, the planned rounds must fit the ε budget (at the start and on a live change),
the privacy section is fixed for the run, and the coordinator's clip is taken down to C. And the
participant's side: Δ is clipped to C before it is encoded, its own copy left as it was."""

from __future__ import annotations

import math
import sys

import pytest
import safetensors.torch
import torch

from fedtrain.config import RunConfig, parse_config
from fedtrain.config.changes import apply_change
from fedtrain.config.privacy import PrivacyConfig
from fedtrain.errors import ConfigError
from fedtrain.participant.engine.sync import SyncEngine

pytest.importorskip("dp_accounting")


def refused(data: dict, *words: str) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    for w in words:
        assert w in e.value.message, e.value.message
    return e.value.message


def test_over_budget_is_refused_with_the_epsilon_it_would_reach() -> None:
    msg = refused({"rounds": 100, "privacy": {"noise_multiplier": 1.0, "epsilon_budget": 10}},
                  "privacy.epsilon_budget", "100 rounds", "over the budget 10", "allows at most")
    eps = float(msg.split("ε=")[1].split(" ")[0])
    assert eps > 10
    ok = parse_config({"rounds": 100, "privacy": {"noise_multiplier": 20.0, "epsilon_budget": 10}})
    assert ok.privacy is not None and ok.privacy.epsilon_budget == 10


def test_no_end_with_a_budget_is_refused_and_says_how_many_rounds_fit() -> None:
    refused({"rounds": 0, "privacy": {"noise_multiplier": 5.0, "epsilon_budget": 8}}, "rounds 0", "allows at most")
    assert parse_config({"rounds": 0, "privacy": {}}).privacy is not None  # no budget: reported only


@pytest.mark.parametrize(("extra", "words"), [
    ({"outer": {"aggregator": "median"}}, ("outer.aggregator median", "sensitivity")),
    ({"outer": {"aggregator": "trimmed_mean"}}, ("trimmed_mean",)),
    ({"outer": {"outlier_factor": 3.0}}, ("outlier_factor",)),
    ({"schedule": {"mode": "async"}}, ("schedule.mode async", "per applied update")),
    ({"late_uploads": "fold"}, ("late_uploads refuse",)),
    ({"privacy": {"sampling": "poisson"}}, ("poisson", "cohort")),
])
def test_what_central_dp_cannot_compose_with_is_refused(extra: dict, words: tuple[str, ...]) -> None:
    data = {"privacy": {}, **extra}
    if "privacy" in extra:
        data["privacy"] = extra["privacy"]
    refused(data, "central DP", *words)
    parse_config({k: v for k, v in data.items() if k != "privacy"})  # fine without DP


def test_the_coordinators_clip_is_taken_down_to_c() -> None:
    assert parse_config({"privacy": {"clip_norm": 0.5}}).outer.clip_norm == 0.5
    assert parse_config({"privacy": {"clip_norm": 0.5}, "outer": {"clip_norm": 9.0}}).outer.clip_norm == 0.5
    assert parse_config({"privacy": {"clip_norm": 0.5}, "outer": {"clip_norm": 0.2}}).outer.clip_norm == 0.2
    assert parse_config({"privacy": {"dp": False, "clip_norm": 0.5}}).outer.clip_norm is None


def test_live_changes_of_the_privacy_section_are_refused_and_rounds_must_fit_the_budget() -> None:
    cfg = parse_config({"rounds": 10, "privacy": {"noise_multiplier": 2.0, "epsilon_budget": 20}})
    for patch in ({"privacy": {"noise_multiplier": 3.0}}, {"privacy": {"clip_norm": 2.0}}, {"privacy": None}):
        with pytest.raises(ConfigError, match="cannot change during a run .*reported ε wrong"):
            apply_change(cfg, patch)
    with pytest.raises(ConfigError, match="over the budget 20"):
        apply_change(cfg, {"rounds": 100_000})
    with pytest.raises(ConfigError, match="outer.aggregator median"):
        apply_change(cfg, {"outer": {"aggregator": "median"}})
    new, diff = apply_change(cfg, {"rounds": 12})
    assert new.rounds == 12 and diff == {"rounds": [10, 12]}


def _engine(delta: dict[str, torch.Tensor]) -> SyncEngine:
    """An engine holding a Δ (its reference snapshot as `prepare` left it, the model moved by −`delta`)."""
    params = {n: torch.nn.Parameter(torch.zeros_like(t)) for n, t in delta.items()}
    engine = SyncEngine(None, params, who="site")  # type: ignore[arg-type]  # encode speaks to no one
    engine.prepare({n: {"dtype": "F32", "shape": list(t.shape)} for n, t in delta.items()})
    engine.restore(sent={n: torch.zeros_like(t) for n, t in delta.items()})  # θ_round = 0
    with torch.no_grad():
        for n, p in params.items():
            p.sub_(delta[n])
    engine.take_delta()
    return engine


def _sent(engine: SyncEngine, data: dict) -> dict[str, torch.Tensor]:
    return safetensors.torch.load(b"".join(bytes(c) for c in engine.encode(parse_config(data))))


def _norm(t: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(x.double().square().sum()) for x in t.values()))


def test_the_participant_clips_its_update_to_c_before_encoding_and_keeps_its_delta() -> None:
    delta = {"a": torch.full((30,), 2.0), "b": torch.full((4, 5), -1.0)}
    engine = _engine(delta)
    sent = _sent(engine, {"privacy": {"clip_norm": 0.5}})
    assert _norm(sent) == pytest.approx(0.5, rel=1e-6)
    for n in delta:  # scaled, not reshaped
        torch.testing.assert_close(sent[n], delta[n] * (0.5 / _norm(delta)))
    again = _sent(engine, {})  # without DP: the Δ it holds is untouched
    for n in delta:
        torch.testing.assert_close(again[n], delta[n])
    small = _engine({"a": torch.full((4,), 0.1)})
    torch.testing.assert_close(_sent(small, {"privacy": {"clip_norm": 5.0}})["a"], torch.full((4,), 0.1))
    bf16 = _sent(engine, {"privacy": {"clip_norm": 0.5}, "train": {"compression": "bf16"}})
    assert _norm({n: t.float() for n, t in bf16.items()}) == pytest.approx(0.5, rel=1e-2)


def test_a_participant_without_the_accountant_takes_the_config_and_a_coordinator_refuses_to_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Participants validate the run config too and need no accountant: without dp-accounting the
    budget is not checked there; the coordinator's `CentralDp` checks it (and the package) at start."""
    from fedtrain.privacy.central import CentralDp

    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # as if not installed
    cfg = parse_config({"rounds": 100, "privacy": {"epsilon_budget": 1.0}})
    assert cfg.privacy is not None
    with pytest.raises(ConfigError, match=r"fedtrain\[privacy\]"):
        CentralDp(cfg.privacy, cfg.rounds)
    monkeypatch.delitem(sys.modules, "dp_accounting")
    with pytest.raises(ConfigError, match="over the budget 1"):
        CentralDp(cfg.privacy, cfg.rounds)


def test_secure_aggregation_alone_adds_no_noise_unless_dp_is_asked_for() -> None:
    def privacy(section: dict[str, object]) -> PrivacyConfig:
        p = RunConfig.model_validate({"privacy": section}).privacy
        assert p is not None
        return p
    assert privacy({}).dp  # a privacy section alone: central DP
    assert not privacy({"secure_aggregation": True}).dp  # masks alone: no σ = 1 nobody asked for
    assert privacy({"secure_aggregation": True, "dp": True}).dp  # distributed DP, by name
    assert not privacy({"secure_aggregation": False, "dp": False}).dp
