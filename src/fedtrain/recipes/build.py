"""One entry point from a run's `ModelConfig` to a model, its loss and its tokens.

`build_model(cfg, seed)` builds the model of either recipe (the built-in GPT or a
`transformers` causal LM) and, when `cfg.lora` is set, wraps it with `peft` LoRA adapters
and freezes everything else, so that the sync set (the trainable parameters) is the
adapters alone. Everything random (GPT init, HF random init, adapter init) is drawn from
the run's seed inside `torch.random.fork_rng`, so the coordinator and every participant
build the same frozen base and the same version-0 adapters, and the global RNG is left
untouched. `base_fingerprint` hashes the frozen part, so that a run can check it.

`loss_fn(cfg)` is the next-token cross-entropy of a batch `(x, y)` for either recipe;
`load_data(cfg, paths)` reads text as the recipe's tokens (bytes, or the model's
tokenizer).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedtrain.config import LoraConfig, ModelConfig
from fedtrain.errors import ConfigError
from fedtrain.recipes import gpt, hf
from fedtrain.recipes.data import load_tokens

__all__ = ["LossFn", "base_fingerprint", "build_model", "load_data", "loss_fn", "tokenizer_of", "unwrap_lora"]

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

# The built-in GPT's Linear layers, for target_modules "all-linear" (peft resolves it only for transformers models).
_GPT_LINEAR = ["c_attn", "c_proj", "c_fc"]


def build_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """The model of `cfg` with weights that depend only on (cfg, seed); LoRA-wrapped when configured."""
    if cfg.recipe == "hf":
        assert cfg.hf is not None
        model = hf.build_hf_model(cfg.hf, seed)
    else:
        model = gpt.build_model(cfg, seed)
    if cfg.lora is not None:
        model = _apply_lora(model, cfg.lora, cfg.recipe, seed)
    return model


def _apply_lora(model: nn.Module, lora: LoraConfig, recipe: str, seed: int) -> nn.Module:
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError:
        raise ConfigError("model.lora needs `peft` (and `transformers`): pip install 'fedtrain[hf]'") from None
    targets: Any = lora.target_modules
    if targets == "all-linear" and recipe == "gpt":
        targets = _GPT_LINEAR
    config = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int; any float scales
        lora_dropout=lora.dropout,
        target_modules=targets,
    )
    # Adapter init uses the global RNG: draw it from the run's seed, and leave the caller's RNG alone.
    with hf.GLOBAL_RNG, torch.random.fork_rng(devices=[]), hf.quiet():
        torch.manual_seed(seed + 1)
        try:
            wrapped = get_peft_model(model, config)
        except ValueError as e:
            raise ConfigError(f"model.lora cannot be applied: {e}") from None
    return wrapped


def unwrap_lora(model: nn.Module, merge: bool) -> nn.Module:
    """The plain model of a LoRA-wrapped one: adapters merged into the base weights, or dropped."""
    if not hasattr(model, "merge_and_unload"):
        return model
    with hf.quiet():
        if merge and not hasattr(getattr(model.get_base_model(), "config", None), "to_dict"):  # type: ignore[operator]
            # The built-in GPT: peft's merge_and_unload reads `model.config` as a transformers config
            # (a dict of it) and fails on our pydantic ModelConfig; merging layer by layer is the same sum.
            from peft.tuners.tuners_utils import BaseTunerLayer

            for layer in model.modules():
                if isinstance(layer, BaseTunerLayer):
                    layer.merge()
            return model.unload()  # type: ignore[operator]
        return model.merge_and_unload() if merge else model.unload()  # type: ignore[operator]


def base_fingerprint(model: nn.Module) -> str:
    """sha256 over the frozen parameters (names, dtypes, shapes, bytes): equal bases, equal fingerprints."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            continue
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def loss_fn(cfg: ModelConfig) -> LossFn:
    """Mean next-token cross-entropy of `model` on (x, y) = (tokens, tokens shifted by one)."""
    if cfg.recipe == "gpt":

        def gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            _, loss = model(x, y)
            return loss

        return gpt_loss

    def hf_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    return hf_loss


def tokenizer_of(cfg: ModelConfig) -> Any | None:
    """The recipe's tokenizer; None means raw UTF-8 bytes."""
    return hf.load_tokenizer(cfg.hf) if cfg.recipe == "hf" and cfg.hf is not None else None


def load_data(cfg: ModelConfig, paths: Sequence[Path], tokenizer: Any | None = None) -> torch.Tensor:
    """Text files as the recipe's 1-D token tensor: bytes (uint8) or the tokenizer's ids (int32)."""
    if tokenizer is None:
        return load_tokens(list(paths))
    return hf.encode_files(paths, tokenizer)


def check_fits(model: nn.Module, cfg: ModelConfig, seq_len: int, tokenizer: Any | None) -> None:
    """Refuse a sequence length or a byte vocabulary the model cannot take, before training."""
    if cfg.recipe != "hf":
        return
    longest = hf.context_length(model)
    if longest is not None and seq_len > longest:
        raise ConfigError(f"train.seq_len ({seq_len}) exceeds the model's context of {longest} positions")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if tokenizer is None and isinstance(vocab, int) and vocab < 256:
        raise ConfigError(f"byte tokens need a vocabulary of at least 256, the model has {vocab}")
