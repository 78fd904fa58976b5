"""`fedtrain export` then `fedtrain.load_model`: the model comes back rebuilt, with the run's
global weights, and computes what the run's global model computes (the built-in GPT, with
LoRA bare and --merged); a custom model's weights load into the caller's own module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fedtrain
from fedtrain.cli import main as fedtrain_main
from fedtrain.config import RunConfig
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.recipes import build_model
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.runs import run_two
from tests.helpers.tiny import Regression, Small, TinyParticipant, init_file, run_all


def trained(tmp_path: Path, cfg: RunConfig) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run of two recipe participants to its end: its state dir and its global weights."""
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        run_two(c.url, tmp_path)
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
    return tmp_path / "state", final


def global_model(cfg: RunConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The run's global model: the recipe's, built from the seed, holding the global sync set."""
    model = build_model(cfg.model, seed=cfg.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(weights[name])
    return model.eval()


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    return out[0] if isinstance(out, tuple) else out


def test_gpt_export_loads_back_as_the_global_model(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=1, train={"sync_every": 3})
    state, final = trained(tmp_path, cfg)
    out = tmp_path / "gpt.safetensors"
    assert fedtrain_main(["export", "--state-dir", str(state), "--out", str(out)]) == 0
    loaded = fedtrain.load_model(out)
    x = torch.randint(0, 256, (2, 16))
    want = logits(global_model(cfg, final), x)
    assert torch.equal(logits(loaded, x), want)
    # the run trained: the global model is not the recipe's initial one, which load_model must not return
    assert not torch.allclose(logits(build_model(cfg.model, seed=cfg.seed), x), want)


def test_gpt_lora_export_loads_back_bare_and_merged(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    lora = {"r": 2, "alpha": 4, "target_modules": "all-linear"}
    cfg = tiny_config(rounds=1, train={"sync_every": 3, "lr": 1e-2}, model={"lora": lora})
    state, final = trained(tmp_path, cfg)
    bare, merged = tmp_path / "adapters.safetensors", tmp_path / "merged.safetensors"
    assert fedtrain_main(["export", "--state-dir", str(state), "--out", str(bare)]) == 0
    assert fedtrain_main(["export", "--state-dir", str(state), "--merged", "--out", str(merged)]) == 0
    x = torch.randint(0, 256, (2, 16))
    want = logits(global_model(cfg, final), x)
    assert torch.allclose(logits(fedtrain.load_model(bare), x), want, atol=1e-6)
    plain = fedtrain.load_model(merged)
    assert not any("lora" in n for n, _ in plain.named_parameters())  # the adapters are merged in
    assert torch.allclose(logits(plain, x), want, atol=1e-5)


def test_a_custom_models_export_loads_into_the_users_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    init = init_file(tmp_path, Small())
    with BackgroundCoordinator(tmp_path / "state", tiny_config(rounds=2, train={"sync_every": 2}),
                               init_weights=init) as c:
        run_all([TinyParticipant(c.url, f"p{i}", Regression(rows=8, seed=10 + i)) for i in range(2)])
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
        out = tmp_path / "custom.safetensors"
        assert fedtrain_main(["export", "--coordinator", c.url, "--token", PTOKEN, "--out", str(out)]) == 0
        merged = str(tmp_path / "merged")
        assert fedtrain_main(["export", "--coordinator", c.url, "--token", PTOKEN, "--merged", "--out", merged]) == 2
    with pytest.raises(fedtrain.ConfigError, match=r"model=MyModel\(\)"):
        fedtrain.load_model(out)  # no GPT is made up for a model of the user's own
    mine = fedtrain.load_model(out, model=Small())
    for name, p in mine.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, final[name]), name
    with pytest.raises(fedtrain.StateError, match=r"lin.weight \(4, 3\) in the file, \(5, 3\) in the model"):
        fedtrain.load_model(out, model=Small(width=5))
