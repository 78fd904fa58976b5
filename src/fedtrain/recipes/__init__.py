"""Ready training recipes on the public API: the byte-level GPT and its offline stdlib data,
any Hugging Face causal LM (optionally with LoRA), and the shipped recipe configs (`*.yaml`).

The names below load on first use (see `fedtrain/__init__.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedtrain._lazy import lazy_exports as _lazy_exports

_SOURCES = {
    "fedtrain.recipes.build": ("base_fingerprint", "build_model", "load_data", "loss_fn", "tokenizer_of"),
    "fedtrain.recipes.data": (
        "TEXT_SUFFIXES",
        "TokenStream",
        "evaluate",
        "heldout_paths",
        "load_tokens",
        "parse_data_spec",
        "stdlib_root",
        "stdlib_shards",
    ),
    "fedtrain.recipes.gpt": ("GPT", "count_parameters"),
    "fedtrain.recipes.load": ("load_model",),
}

if TYPE_CHECKING:
    from fedtrain.recipes.build import base_fingerprint, build_model, load_data, loss_fn, tokenizer_of
    from fedtrain.recipes.data import (
        TEXT_SUFFIXES,
        TokenStream,
        evaluate,
        heldout_paths,
        load_tokens,
        parse_data_spec,
        stdlib_root,
        stdlib_shards,
    )
    from fedtrain.recipes.gpt import GPT, count_parameters
    from fedtrain.recipes.load import load_model
else:
    __getattr__, __dir__ = _lazy_exports(__name__, _SOURCES)

__all__ = [
    "GPT",
    "TEXT_SUFFIXES",
    "TokenStream",
    "base_fingerprint",
    "build_model",
    "count_parameters",
    "evaluate",
    "heldout_paths",
    "load_data",
    "load_model",
    "load_tokens",
    "loss_fn",
    "parse_data_spec",
    "stdlib_root",
    "stdlib_shards",
    "tokenizer_of",
]
