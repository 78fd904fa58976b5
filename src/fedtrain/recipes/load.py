"""`fedtrain.load_model(path)`: a model exported by `fedtrain export`, rebuilt and loaded.

An export of a recipe run carries what rebuilds its model: the safetensors file's metadata
(`MODEL_KEY`) holds the run's `model` config, its seed and which weights the file holds —
the sync set (the trainable parameters, as the coordinator stores them) or the whole model
(`--merged`). A LoRA run's sync set is the adapters alone: the frozen base is built again
from the same seed (or read from the same local files), as every participant builds it.
A transformers directory (`--merged` of an hf run) loads with `from_pretrained`; a peft
adapter directory (`--adapter`) loads onto its base, rebuilt from `fedtrain-model.json`.

The weights of a custom model (a run started with `--init-weights`) carry no recipe: they
load into the caller's own module, `load_model(path, model=MyNet())`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedtrain.config import ModelConfig
from fedtrain.errors import ConfigError, StateError

__all__ = ["MODEL_FILE", "MODEL_KEY", "describe_model", "load_model"]

MODEL_KEY = "fedtrain.model"
"""The safetensors metadata key (and, in an exported directory, `MODEL_FILE`) of the model's description."""

MODEL_FILE = "fedtrain-model.json"


def describe_model(model: ModelConfig | None, seed: int, weights: str) -> str:
    """The JSON that `load_model` rebuilds from: the run's model config and seed, and whether the
    file holds the `sync_set` or the `whole` model; `model` None: a custom model (no recipe)."""
    if model is None:
        return json.dumps({"source": "custom", "weights": weights})
    return json.dumps({"source": "recipe", "model": model.model_dump(mode="json"), "seed": seed, "weights": weights})


def load_model(path: str | Path, model: nn.Module | None = None) -> nn.Module:
    """The model `fedtrain export` wrote to `path`, with the exported weights, in eval mode.

    A safetensors file from a recipe run is rebuilt from its metadata (the built-in GPT, or the
    transformers model of an hf run, LoRA-wrapped when the run used LoRA and the file holds the
    adapters); given `model`, the weights load into it instead (a custom model's run needs it).
    A directory: a transformers model (`--merged` of an hf run) or a peft adapter (`--adapter`)."""
    path = Path(path)
    if path.is_dir():
        return _load_dir(path, model).eval()
    if not path.is_file():
        raise StateError(f"{path}: no such file or directory")
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise StateError(f"{path} is not a safetensors file: {e}") from None
    about = _about(meta.get(MODEL_KEY), path)
    weights = about.get("weights", "sync_set")
    if model is None:
        if about.get("source") != "recipe":
            raise ConfigError(
                f"{path} holds the weights of a model of your own (a run started with --init-weights) or carries no "
                "model config (an export of an older fedtrain): pass the module to load them into, "
                "load_model(path, model=MyModel())"
            )
        model = _rebuild(about, weights)
    _copy_into(model, tensors, whole=weights == "whole", where=path)
    return model.eval()


def _about(text: str | None, where: Path) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        about = json.loads(text)
    except ValueError:
        raise StateError(f"{where}: its {MODEL_KEY} metadata is not JSON") from None
    if not isinstance(about, dict):
        raise StateError(f"{where}: its {MODEL_KEY} metadata is not a JSON object")
    return about


def _rebuild(about: dict[str, Any], weights: str) -> nn.Module:
    """The recipe's model of `about` (built from its seed), without LoRA for a whole-model file."""
    from fedtrain.recipes.build import build_model

    cfg = ModelConfig.model_validate(about["model"])
    if weights == "whole":
        cfg = cfg.model_copy(update={"lora": None})
    return build_model(cfg, seed=int(about.get("seed", 0)))


def _copy_into(model: nn.Module, tensors: dict[str, torch.Tensor], *, whole: bool, where: Path) -> None:
    """The file's tensors into `model`: every tensor of its state dict (`whole`), else its
    trainable parameters (the sync set); names and shapes must match exactly."""
    state = model.state_dict()
    whole = whole or set(tensors) == set(state)  # a sync set that is the whole model (no buffers, nothing frozen)
    targets = dict(state) if whole else {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing, extra = sorted(set(targets) - set(tensors)), sorted(set(tensors) - set(targets))
    wrong = [f"{n} {tuple(tensors[n].shape)} in the file, {tuple(targets[n].shape)} in the model"
             for n in sorted(set(targets) & set(tensors)) if tuple(targets[n].shape) != tuple(tensors[n].shape)]
    if missing or extra or wrong:
        parts = [f"{label}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                 for label, names in (("missing", missing), ("unexpected", extra), ("other shape", wrong)) if names]
        raise StateError(f"{where} does not fit the model ({'; '.join(parts)})")
    with torch.no_grad():
        for name, t in targets.items():
            t.copy_(tensors[name])


def _load_dir(path: Path, model: nn.Module | None) -> nn.Module:
    from fedtrain.recipes import hf

    if (path / "adapter_config.json").is_file():
        if model is None:
            about = _about((path / MODEL_FILE).read_text() if (path / MODEL_FILE).is_file() else None, path)
            if about.get("source") != "recipe":
                raise ConfigError(f"{path} is a LoRA adapter without its run's model config: pass its base model, "
                                  "load_model(path, model=base)")
            model = _rebuild(about, "whole")  # the frozen base alone, from the run's seed
        try:
            from peft import PeftModel
        except ImportError:
            raise ConfigError("a LoRA adapter needs `peft`: pip install 'fedtrain[hf]'") from None
        with hf.quiet():
            return PeftModel.from_pretrained(model, str(path))
    if (path / "config.json").is_file():
        transformers = hf._transformers()
        with hf.quiet():
            return transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    raise StateError(f"{path} is neither a transformers model directory (config.json) nor a peft adapter "
                     "(adapter_config.json)")
