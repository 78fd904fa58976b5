"""The demo's DiLoCo outer lr follows the recommended table for its participants and H; its
compression is the recommended preset's."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedtrain.cli import build_parser
from fedtrain.cli.demo import RECOMMENDED_COMPRESSION, demo_config
from fedtrain.config import outer_defaults


@pytest.mark.parametrize(
    "argv,lr",
    [([], 0.85),  # 4 participants, H = 40
     (["--participants", "2"], 0.4),
     (["--participants", "8", "--sync-every", "10"], 0.4),
     (["--participants", "2", "--sync-every", "100"], 0.7),
     (["--participants", "4", "--sync-every", "100"], 1.0),
     (["--heterogeneous", "--sync-every", "60"], 0.7)],  # 3 participants
)
def test_the_demo_runs_the_recommended_outer_lr_for_its_participants(argv: list[str], lr: float) -> None:
    """Every round of the demo waits for all its participants (min_participants is their
    count), and the lr is pinned for them."""
    cfg = demo_config(build_parser().parse_args(["demo", *argv]))
    assert cfg.outer.lr == lr and outer_defaults(cfg)["lr"] == lr
    n = int(argv[argv.index("--participants") + 1]) if "--participants" in argv else 3 if "--heterogeneous" in argv \
        else 4
    assert cfg.min_participants == n


def test_the_demo_keeps_a_given_lr_and_other_algorithms_defaults(tmp_path: Path) -> None:
    own = tmp_path / "run.yaml"
    own.write_text("outer: {lr: 0.25}\n")
    assert demo_config(build_parser().parse_args(["demo", "--config", str(own)])).outer.lr == 0.25
    fedavg = demo_config(build_parser().parse_args(["demo", "--algorithm", "fedavg"]))
    assert fedavg.outer.lr is None and outer_defaults(fedavg)["lr"] == 1.0


def test_the_demo_compresses_both_ways_with_the_recommended_preset_unless_told(tmp_path: Path) -> None:
    """docs/quality.md's recommended preset (#32) both ways by default; --compression picks another
    (bf16 uploads, whole downloads); a --config keeps its own."""
    cfg = demo_config(build_parser().parse_args(["demo"]))
    assert (cfg.train.compression, cfg.train.download_compression) == (RECOMMENDED_COMPRESSION,) * 2
    assert (cfg.train.compression_block, cfg.train.compression_scale, cfg.train.entropy_coding) == (64, "bf16",
                                                                                                    "deflate")
    cfg = demo_config(build_parser().parse_args(["demo", "--compression", "int2"]))  # the scheme alone
    assert (cfg.train.compression_block, cfg.train.compression_scale, cfg.train.entropy_coding) == (256, "fp32",
                                                                                                    "none")
    cfg = demo_config(build_parser().parse_args(["demo", "--compression", "none"]))
    assert (cfg.train.compression, cfg.train.download_compression) == ("none", "none")
    cfg = demo_config(build_parser().parse_args(["demo", "--compression", "bf16"]))
    assert (cfg.train.compression, cfg.train.download_compression) == ("bf16", "none")
    own = tmp_path / "run.yaml"
    own.write_text("train: {compression: int8}\n")
    cfg = demo_config(build_parser().parse_args(["demo", "--config", str(own)]))
    assert (cfg.train.compression, cfg.train.download_compression) == ("int8", "none")
