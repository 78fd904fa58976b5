"""Run config: defaults, validation messages naming file and field, shipped files load."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedtrain.config import RunConfig, load_config, outer_defaults, parse_config
from fedtrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid() -> None:
    cfg = RunConfig()
    assert cfg.outer.algorithm == "diloco"
    assert outer_defaults(cfg.outer)["lr"] == 0.7


@pytest.mark.parametrize(
    "algorithm,lr,momentum,nesterov",
    [("fedavg", 1.0, 0.0, False), ("diloco", 0.7, 0.9, True), ("fedavgm", 1.0, 0.9, False)],
)
def test_outer_defaults(algorithm: str, lr: float, momentum: float, nesterov: bool) -> None:
    hp = outer_defaults(parse_config({"outer": {"algorithm": algorithm}}).outer)
    assert (hp["lr"], hp["momentum"], hp["nesterov"]) == (lr, momentum, nesterov)


def test_unknown_field_and_bad_value_are_named() -> None:
    with pytest.raises(ConfigError, match=r"train\.sync_everyy"):
        parse_config({"train": {"sync_everyy": 3}})
    with pytest.raises(ConfigError, match=r"outer\.algorithm"):
        parse_config({"outer": {"algorithm": "sgd"}})
    with pytest.raises(ConfigError, match="seq_len"):
        parse_config({"train": {"seq_len": 512}, "model": {"block_size": 128}})


def test_load_config_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [unclosed")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"rounds": -1}')
    with pytest.raises(ConfigError, match=r"wrong.json: rounds"):
        load_config(wrong)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)


def test_every_shipped_config_loads() -> None:
    shipped = sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "src/fedtrain/recipes").glob("*.yaml"))
    assert shipped, "no config files found"
    for path in shipped:
        load_config(path)


def test_config_reference_doc_is_current() -> None:
    from fedtrain.config_doc import reference

    doc = (ROOT / "docs" / "config.md").read_text()
    assert doc == reference(), "docs/config.md is stale: run `python -m fedtrain.config_doc > docs/config.md`"
    for field in ("train.sync_every", "outer.algorithm", "model.n_layer", "round_timeout_s"):
        assert f"`{field}`" in doc
