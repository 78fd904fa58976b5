"""The `streaming` section of the run config: what it needs of the rest, and what may change live."""

from __future__ import annotations

from typing import Any

import pytest

from fedtrain.config import RunConfig, parse_config
from fedtrain.config.changes import apply_change, fixed_reason
from fedtrain.errors import ConfigError

STREAMING = {"train": {"sync_every": 30}, "streaming": {"fragments": 2, "overlap": 1, "alpha": 0.5}}


def run(**over: Any) -> RunConfig:
    return parse_config({**STREAMING, **over})


def test_a_streaming_config_validates_and_is_off_by_default() -> None:
    assert RunConfig().streaming is None
    st = run().streaming
    assert st is not None and (st.fragments, st.assign, st.overlap, st.alpha) == (2, "strided", 1, 0.5)


@pytest.mark.parametrize(("over", "message"), [
    ({"train": {"sync_every": 31}}, "must be a multiple of streaming.fragments"),
    ({"streaming": {"fragments": 2, "overlap": 15}}, "less than H/K = 15"),
    ({"schedule": {"mode": "async"}}, "needs schedule.mode rounds"),
    ({"schedule": {"mode": "balanced"}}, "needs schedule.mode rounds"),
    ({"late_uploads": "fold"}, "needs late_uploads refuse"),
    ({"streaming": {"fragments": 3, "assign": [["a*"], ["b*"]]}, "train": {"sync_every": 30}}, "2 pattern lists for 3"),
    ({"streaming": {"alpha": 1.5}}, "less than or equal to 1"),
])
def test_what_streaming_cannot_run_with_is_refused_with_the_reason(over: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run(**over)


def test_overlap_alpha_and_h_change_live_but_fragments_and_assign_do_not() -> None:
    cfg = run()
    new, diff = apply_change(cfg, {"streaming": {"overlap": 3, "alpha": 0.25}, "train": {"sync_every": 40}})
    assert new.streaming is not None and (new.streaming.overlap, new.streaming.alpha) == (3, 0.25)
    assert set(diff) == {"streaming.overlap", "streaming.alpha", "train.sync_every"}
    with pytest.raises(ConfigError, match=r"streaming.fragments cannot change during a run \(each fragment keeps"):
        apply_change(cfg, {"streaming": {"fragments": 3}})
    with pytest.raises(ConfigError, match="streaming.assign cannot change during a run"):
        apply_change(cfg, {"streaming": {"assign": "sequential"}})
    with pytest.raises(ConfigError, match="must be a multiple of streaming.fragments"):
        apply_change(cfg, {"train": {"sync_every": 31}})
    with pytest.raises(ConfigError, match="cannot change during a run"):  # turning it off
        apply_change(cfg, {"streaming": None})
    with pytest.raises(ConfigError, match="cannot change during a run"):  # turning it on
        apply_change(RunConfig(), {"streaming": {"fragments": 2}, "train": {"sync_every": 20}})


def test_fixed_fields_are_named_by_dotted_path() -> None:
    assert fixed_reason("model.n_layer") is not None and fixed_reason("seed") is not None
    assert fixed_reason("streaming") is not None and fixed_reason("streaming.fragments") is not None
    assert fixed_reason("streaming.overlap") is None and fixed_reason("train.lr") is None
