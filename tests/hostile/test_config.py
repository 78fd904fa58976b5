"""Hostile and careless run-config numbers (issue #30): every number of the run config has a working
range, and combinations that cannot work are refused at validation, with the reason and the field,
through every door a config comes in by: `parse_config`, a config file (the CLI's
`fedtrain coordinator --config`), and the live-config API (`POST /v1/config/validate`, `PUT /v1/config`).

The first test walks the schema, so a numeric field added without bounds fails here by itself."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import annotated_types
import httpx
import pytest
import yaml
from pydantic import BaseModel

from fedtrain.config import MAX_UPDATE_TOKENS, RunConfig, load_config, parse_config
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.policy import token_bound
from fedtrain.errors import ConfigError
from tests.helpers.api import assert_error
from tests.helpers.config import ATOKEN, tiny_config
from tests.helpers.processes import assert_clean_error, fedtrain


def _numeric(annotation: Any) -> bool:
    args = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    return any(a in (int, float) for a in args)


def _section(annotation: Any) -> type[BaseModel] | None:
    args = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    return next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)


def numeric_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> Iterator[tuple[str, Any, list]]:
    """(dotted path, annotation, constraints) of every int or float field of the run config."""
    for name, field in model.model_fields.items():
        section = _section(field.annotation)
        if section is not None:
            yield from numeric_fields(section, f"{prefix}{name}.")
        elif _numeric(field.annotation):
            yield f"{prefix}{name}", field.annotation, field.metadata


def _bound(metadata: list, *kinds: type) -> float | None:
    for m in metadata:
        for kind in kinds:
            if isinstance(m, kind):
                return getattr(m, kind.__name__.lower())
    return None


FIELDS = list(numeric_fields())


def patch_of(path: str, value: Any) -> dict[str, Any]:
    *parents, leaf = path.split(".")
    patch: dict[str, Any] = {leaf: value}
    for key in reversed(parents):
        patch = {key: patch}
    return patch


def too_large(annotation: Any, metadata: list) -> Any:
    """The smallest value past the field's upper bound."""
    le, lt = _bound(metadata, annotated_types.Le), _bound(metadata, annotated_types.Lt)
    if lt is not None:
        return lt
    assert le is not None
    return le + 1 if int in (get_args(annotation) or (annotation,)) and float not in get_args(annotation) else le * 2


def test_every_number_of_the_run_config_has_a_working_range() -> None:
    assert len(FIELDS) > 50  # the walk finds the sections' fields too
    unbounded = [p for p, _, meta in FIELDS if _bound(meta, annotated_types.Le, annotated_types.Lt) is None
                 or _bound(meta, annotated_types.Ge, annotated_types.Gt) is None]
    assert unbounded == [], f"run-config numbers without a lower and an upper bound: {unbounded}"


@pytest.mark.parametrize(("path", "annotation", "metadata"), FIELDS, ids=[p for p, _, _ in FIELDS])
def test_a_number_past_its_range_is_refused_naming_the_field(path: str, annotation: Any, metadata: list) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(patch_of(path, too_large(annotation, metadata)))
    assert f"{path}:" in e.value.message and "less than" in e.value.message


# -- combinations that cannot work ------------------------------------------------------------------

BIG_SCHEDULE = {"train": {"sync_every": 10_000, "batch_size": 20_000, "seq_len": 32}}  # x16 slack: 1.0e11

COMBINATIONS: dict[str, tuple[dict[str, Any], list[str]]] = {
    # a token bound past 2^40 per update: two of the largest claims would overflow the sums
    "token_bound": ({"train": {"sync_every": 1_000_000, "batch_size": 1_000_000, "seq_len": 32},
                     "outer": {"token_slack": 1024}},
                    ["train.sync_every", "train.batch_size", "train.seq_len", "outer.token_slack", "2^40"]),
    "token_bound_balanced": ({**BIG_SCHEDULE, "schedule": {"mode": "balanced", "max_steps_factor": 16}},
                             ["schedule.max_steps_factor 16", "outer.token_slack", "2^40"]),
    "adaptive_deadline": ({"deadline": "adaptive", "deadline_min_s": 700, "round_timeout_s": 600},
                          ["deadline_min_s (700)", "round_timeout_s (600)"]),
    "heartbeat": ({"heartbeat_interval_s": 30, "heartbeat_timeout_s": 20}, ["heartbeat_timeout_s"]),
    "seq_len": ({"train": {"seq_len": 64}}, ["train.seq_len (64)", "model.block_size (32)"]),
    "streaming_h": ({"streaming": {"fragments": 3}}, ["train.sync_every (H=5)", "streaming.fragments (K=3)"]),
    # a participant's own outer momentum beside the coordinator's: the two would compound
    "upload_momentum_twice": ({"train": {"upload_momentum": 0.9}, "outer": {"algorithm": "diloco"}},
                              ["train.upload_momentum 0.9", "outer.algorithm diloco", "compound"]),
    "upload_momentum_dp": ({"train": {"upload_momentum": 0.9}, "outer": {"algorithm": "fedavg"},
                            "privacy": {"clip_norm": 1.0, "noise_multiplier": 1.0}},
                           ["train.upload_momentum", "differential privacy"]),
}

TINY = tiny_config(rounds=0).model_dump(mode="json")


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in patch.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_the_big_schedule_alone_fits_and_its_bound_stays_below_2_to_the_40() -> None:
    fits = parse_config(merged(TINY, BIG_SCHEDULE))
    assert token_bound(fits)[0] <= MAX_UPDATE_TOKENS
    top = parse_config(merged(TINY, {**BIG_SCHEDULE, "schedule": {"mode": "balanced", "max_steps_factor": 4}}))
    assert token_bound(top, told=4 * 10_000)[0] <= MAX_UPDATE_TOKENS


@pytest.mark.parametrize("case", sorted(COMBINATIONS))
def test_a_combination_that_cannot_work_is_refused_with_the_reason(case: str, tmp_path: Path) -> None:
    patch, needles = COMBINATIONS[case]
    with pytest.raises(ConfigError) as e:
        parse_config(merged(TINY, patch))
    assert all(n in e.value.message for n in needles), e.value.message
    path = tmp_path / "run.yaml"  # the same from a file, which names it
    path.write_text(yaml.safe_dump(merged(TINY, patch)))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in e.value.message and all(n in e.value.message for n in needles)


def test_the_cli_refuses_a_config_file_with_a_number_past_its_range(tmp_path: Path) -> None:
    """`fedtrain coordinator --config`: one line naming the file and the field, exit 2, nothing made
    (before: the coordinator started with it and served until the first commit failed)."""
    bad = tmp_path / "slack.yaml"
    bad.write_text(yaml.safe_dump({"outer": {"token_slack": 1e18}}))
    r = fedtrain("coordinator", "--config", str(bad), "--state-dir", str(tmp_path / "s"), "--port", "0", timeout=60)
    assert_clean_error(r, "slack.yaml", "outer.token_slack")
    assert not (tmp_path / "s").exists()


# -- the live-config API ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with BackgroundCoordinator(tmp_path_factory.mktemp("live") / "s", tiny_config(rounds=0)) as c, \
            httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {ATOKEN}"}, timeout=30) as http:
        yield http


LIVE = [(p, a, m) for p, a, m in FIELDS if not p.startswith("model.") and not p.startswith("streaming.")]


def test_the_live_config_route_refuses_every_number_past_its_range_naming_the_field(live: httpx.Client) -> None:
    refused = {}
    for path, annotation, metadata in LIVE:
        v = live.post("/v1/config/validate", json={"changes": patch_of(path, too_large(annotation, metadata))})
        assert v.status_code == 200, v.text
        refused[path] = v.json()
        assert refused[path]["valid"] is False and f"{path}:" in refused[path]["error"], (path, refused[path])
    assert len(refused) > 40
    err = assert_error(live.put("/v1/config", json={"changes": {"outer": {"token_slack": 1e18}}}), 422)
    assert "outer.token_slack" in err["message"]
    assert live.get("/v1/config").json()["version"] == 1  # nothing was changed


@pytest.mark.parametrize("case", ["token_bound", "token_bound_balanced", "adaptive_deadline", "heartbeat", "seq_len"])
def test_the_live_config_route_refuses_a_combination_that_cannot_work(live: httpx.Client, case: str) -> None:
    patch, needles = COMBINATIONS[case]
    v = live.post("/v1/config/validate", json={"changes": patch}).json()
    assert v["valid"] is False and all(n in v["error"] for n in needles), v
    err = assert_error(live.put("/v1/config", json={"changes": patch}), 422)
    assert all(n in err["message"] for n in needles)
    assert live.get("/v1/config").json()["version"] == 1
