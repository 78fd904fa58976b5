"""Ready training recipes on the public API: the byte-level GPT and its offline stdlib data."""

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
from fedtrain.recipes.gpt import GPT, build_model, count_parameters

__all__ = [
    "GPT",
    "TEXT_SUFFIXES",
    "TokenStream",
    "build_model",
    "count_parameters",
    "evaluate",
    "heldout_paths",
    "load_tokens",
    "parse_data_spec",
    "stdlib_root",
    "stdlib_shards",
]
