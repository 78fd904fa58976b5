"""`fedtrain export`: the global model from a coordinator or a state dir.

By default the global weights as stored (the sync set) in one safetensors file. For a
whole model the run's recipe rebuilds it from the run config (the frozen base comes from
the same seed or the same local files) and loads the global weights into it:
`--adapter` writes a LoRA run's adapter alone as a peft directory (load it with
`PeftModel.from_pretrained(base, DIR)`); `--merged` writes the base with the adapter merged
in (or the whole model of a full run): a transformers directory (`from_pretrained(DIR)`)
for hf runs, one safetensors file for the built-in GPT.

Every export of a recipe run carries what rebuilds its model (the run's `model` config and
seed: the safetensors metadata `fedtrain.model`, or `fedtrain-model.json` in an adapter
directory), so that `fedtrain.load_model(path)` returns it loaded. A custom model's run
(`--init-weights`) has no recipe: its file says so, and loads into the user's own module.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedtrain.config import RunConfig, parse_config
from fedtrain.coordinator.model.checkpoints import CheckpointDir
from fedtrain.coordinator.state.store import Store
from fedtrain.errors import ConfigError, StateError
from fedtrain.recipes.load import MODEL_FILE, MODEL_KEY, describe_model
from fedtrain.wire import digest_chunks, iter_file, read_tensors, write_file

if TYPE_CHECKING:
    from fedtrain.participant.client.coordinator_client import CoordinatorClient


def export_model(args: argparse.Namespace, connect: Callable[[], CoordinatorClient]) -> tuple[int, int, str]:
    """Write the chosen global version to args.out; returns (version, tensors, digest). The
    model comes from `args.state_dir`, else from the coordinator `connect()` opens a client to
    (the command line's token and TLS settings are the CLI's to read, not this module's)."""
    whole = bool(getattr(args, "adapter", False) or getattr(args, "merged", False))
    if args.state_dir is not None:
        version, tensors = _from_state_dir(args.state_dir, args.version)
        config, custom = _config_of_state_dir(args.state_dir)
    else:
        with connect() as client:
            version, tensors = client.download(version=args.version)
            view = client.get_config()
            config = parse_config(view["config"], source="the run's config")
            custom = (view.get("model") or {}).get("source") == "custom"
    if whole:
        if custom:
            raise ConfigError("--adapter and --merged rebuild the run's recipe model, and this run federates a model "
                              "of its own (--init-weights): export without them, and load the file into your module "
                              "with fedtrain.load_model(PATH, model=YourModel())")
        n, digest = write_model(config, tensors, args.out, adapter_only=bool(args.adapter))
        return version, n, digest
    about = describe_model(None if custom else config.model, config.seed, "sync_set")
    digest = write_file(args.out, tensors, {"version": str(version), "exported_by": "fedtrain", MODEL_KEY: about})
    return version, len(tensors), digest


def _config_of_state_dir(state_dir: Path) -> tuple[RunConfig, bool]:
    """The run's newest config, and whether it federates a custom model (--init-weights)."""
    store = Store(state_dir / "run.db")
    try:
        found = store.latest_config()
        custom = store.get_meta("model_source") == "init_weights"
    finally:
        store.close()
    if found is None:
        raise StateError(f"{state_dir} holds no run config")
    return parse_config(found[1], source=f"the run config in {state_dir}"), custom


def write_model(
    config: RunConfig, tensors: dict[str, torch.Tensor], out: Path, *, adapter_only: bool
) -> tuple[int, str]:
    """Rebuild the run's model with `tensors` as its sync set and write the adapter or the merged
    model to `out`; returns (tensors written, digest of the weights file)."""
    from fedtrain.recipes.build import build_model, tokenizer_of, unwrap_lora

    if adapter_only and config.model.lora is None:
        raise ConfigError("--adapter needs a LoRA run (model.lora is not set); export without it")
    model = build_model(config.model, seed=config.seed)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(tensors):
        raise StateError("the global weights do not match the sync set of the run's model (a different recipe?)")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])
    if adapter_only:
        model.save_pretrained(str(out), safe_serialization=True)  # type: ignore[operator]
        # what rebuilds the frozen base: load_model(out) puts the adapter back on it
        (out / MODEL_FILE).write_text(describe_model(config.model, config.seed, "adapter"))
        return len(params), _digest_of(out / "adapter_model.safetensors")
    plain = unwrap_lora(model, merge=True)
    if config.model.recipe == "gpt":
        state = {k: v.detach().contiguous() for k, v in plain.state_dict().items()}
        about = describe_model(config.model.model_copy(update={"lora": None}), config.seed, "whole")
        return len(state), write_file(out, state, {"exported_by": "fedtrain", "merged": "true", MODEL_KEY: about})
    plain.save_pretrained(str(out), safe_serialization=True)  # type: ignore[operator]
    tokenizer: Any = tokenizer_of(config.model)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    weights = sorted(out.glob("*.safetensors"))
    return len(plain.state_dict()), _digest_of(weights[0]) if len(weights) == 1 else f"{len(weights)} shards"


def _digest_of(path: Path) -> str:
    return digest_chunks(iter_file(path))


def _from_state_dir(state_dir: Path, version: int | None) -> tuple[int, dict]:
    db = state_dir / "run.db"
    if not db.is_file():
        raise StateError(f"{state_dir} is not a coordinator state directory (no run.db)")
    store = Store(db)
    try:
        committed = store.committed_version()
        if committed is None:
            raise StateError(f"{state_dir} holds no committed model yet")
        v = committed if version is None else version
        if v > committed:
            raise StateError(f"version {v} is not committed (latest: {committed})")
        digest = store.get_meta(f"digest/{v}")
    finally:
        store.close()
    path = CheckpointDir(state_dir / "checkpoints").global_path(v)
    if not path.is_file():
        raise StateError(f"global model version {v} is no longer kept in {state_dir}")
    return v, dict(read_tensors(iter_file(path), expected_digest=digest))
