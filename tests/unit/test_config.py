"""Run config: defaults, validation messages naming file and field, shipped files load."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedtrain.config import RunConfig, load_config, outer_choice, outer_defaults, parse_config
from fedtrain.config.changes import change_notes
from fedtrain.errors import ConfigError
from fedtrain.merge.outer_lr import recommended_outer_lr

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid() -> None:
    cfg = RunConfig()
    assert cfg.outer.algorithm == "diloco"
    assert (cfg.min_participants, cfg.train.sync_every) == (1, 20)
    assert outer_defaults(cfg)["lr"] == 0.4  # the recommended table's M <= 3, H 18-54 point


@pytest.mark.parametrize(
    "algorithm,lr,momentum,nesterov",
    [("fedavg", 1.0, 0.0, False), ("diloco", 0.4, 0.9, True), ("fedavgm", 1.0, 0.9, False)],
)
def test_outer_defaults(algorithm: str, lr: float, momentum: float, nesterov: bool) -> None:
    hp = outer_defaults(parse_config({"outer": {"algorithm": algorithm}}))
    assert (hp["lr"], hp["momentum"], hp["nesterov"]) == (lr, momentum, nesterov)


@pytest.mark.parametrize(
    "m,h,lr",
    [(1, 5, 0.4), (2, 10, 0.4), (4, 17, 0.4), (8, 17, 0.4),  # H < 18: the H = 10 column
     (1, 18, 0.4), (2, 30, 0.4), (3, 54, 0.4),  # H 18-54, M <= 3: M = 2, H = 30
     (4, 18, 0.85), (4, 30, 0.85), (16, 54, 0.85),  # H 18-54, M >= 4: M = 4, H = 30
     (1, 55, 0.7), (3, 100, 0.7), (4, 55, 1.0), (8, 500, 1.0)],  # H >= 55: the H = 100 column
)
def test_the_diloco_outer_lr_follows_the_recommended_table(m: int, h: int, lr: float) -> None:
    """docs/quality.md's table by M (min_participants) and H (train.sync_every), at and on both
    sides of each edge; a given lr wins, and other algorithms keep their one default."""
    cfg = parse_config({"min_participants": m, "train": {"sync_every": h}})
    assert outer_defaults(cfg)["lr"] == recommended_outer_lr(m, h) == lr
    assert outer_choice(cfg) == ("diloco", outer_defaults(cfg))
    given = parse_config({"min_participants": m, "train": {"sync_every": h}, "outer": {"lr": 0.3}})
    assert outer_defaults(given)["lr"] == 0.3
    fedavg = parse_config({"min_participants": m, "train": {"sync_every": h}, "outer": {"algorithm": "fedavg"}})
    assert outer_defaults(fedavg)["lr"] == 1.0


def test_the_recommended_table_refuses_what_it_cannot_answer() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        recommended_outer_lr(0, 30)


def test_a_change_that_moves_the_unset_diloco_lr_says_so() -> None:
    """A change of H (or M) that moves the table's lr is noted with both values; a pinned lr, a
    change the table does not see, or another algorithm says nothing about it."""
    old = parse_config({"train": {"sync_every": 30}})
    new = parse_config({"train": {"sync_every": 100}})
    notes = change_notes(old, new)
    assert len(notes) == 1 and "0.4 -> 0.7" in notes[0] and "set outer.lr to pin it" in notes[0]
    assert "0.4 -> 0.85" in change_notes(old, parse_config({"train": {"sync_every": 30}, "min_participants": 4}))[0]
    assert change_notes(old, parse_config({"train": {"sync_every": 10}})) == []
    pinned = {"outer": {"lr": 0.5}}
    assert change_notes(parse_config({**pinned, "train": {"sync_every": 30}}),
                        parse_config({**pinned, "train": {"sync_every": 100}})) == []
    fedavg = {"outer": {"algorithm": "fedavg"}}
    assert change_notes(parse_config({**fedavg, "min_participants": 1}),
                        parse_config({**fedavg, "min_participants": 4})) == []


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
    from fedtrain.config.doc import reference

    doc = (ROOT / "docs" / "config.md").read_text()
    assert doc == reference(), "docs/config.md is stale: run `python -m fedtrain.config.doc > docs/config.md`"
    for field in ("train.sync_every", "outer.algorithm", "model.n_layer", "round_timeout_s"):
        assert f"`{field}`" in doc
