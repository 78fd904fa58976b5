"""FSDP2 for the recipes: join the torchrun group and shard the run's model with `fully_shard`.

What is sharded, per recipe (`shard_model`): the built-in GPT gets one `fully_shard` per
block, then one on the root (embeddings, final norm); a Hugging Face causal LM one per
decoder layer (the classes its `_no_split_modules` names: `LlamaDecoderLayer`, `GPT2Block`,
...), then the root (embeddings, final norm, head). Each parameter becomes a DTensor whose
rows (dimension 0) are split over the ranks as `torch.chunk` splits them.

With LoRA the frozen base is sharded as well as the adapters: FSDP2 (torch 2.13) takes a
unit that mixes frozen and trainable parameters, all-gathers both for the forward and
reduces gradients of the trainable ones only. Only the trainable parameters get gradients
and optimizer state and are synced with the coordinator, so only adapter rows travel.

Build the optimizer after `shard_model`: its parameters must be the DTensors.
`torch.nn.utils.clip_grad_norm_` works on them as it is (the norm is a DTensor reduced over
the ranks).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from fedtrain.errors import ConfigError
from fedtrain.participant.ranks.shards import local_tensor
from fedtrain.participant.ranks.torchrun import init_from_env
from fedtrain.recipes import gpt

__all__ = ["PARALLEL", "held_bytes", "init_fsdp", "shard_model", "shard_units"]

log = logging.getLogger("fedtrain.recipe")

PARALLEL = ("ddp", "fsdp")
"""How the ranks of a torchrun participant share the model: a DDP replica each, or FSDP2 shards."""

_UNDER_TORCHRUN = "`--parallel fsdp` runs under torchrun: torchrun --nproc_per_node N -m fedtrain participant "
_UNDER_TORCHRUN += "--parallel fsdp ... (or fedtrain torchrun --nproc_per_node N -m fedtrain participant ...)"


def init_fsdp(device: str = "cpu") -> tuple[int, int, torch.device]:
    """Join the torchrun group, even of one rank (FSDP needs a process group for its mesh):
    (rank, world size, this rank's device). Outside torchrun: a ConfigError saying how to launch."""
    if not dist.is_initialized() and not ("MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ):
        raise ConfigError(_UNDER_TORCHRUN)
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401 - torch >= 2.6
    except ImportError:
        raise ConfigError(f"`--parallel fsdp` needs FSDP2 (torch >= 2.6); this is torch {torch.__version__}") from None
    rank, world, where = init_from_env(device)
    if not dist.is_initialized():  # a world of 1: init_from_env leaves it alone
        dist.init_process_group(backend="nccl" if where.type == "cuda" else "gloo")
    return rank, world, where


def shard_units(model: nn.Module, recipe: str) -> list[nn.Module]:
    """The modules that get a `fully_shard` of their own, before the root: the GPT's blocks,
    or a transformers model's decoder layers (its `_no_split_modules`)."""
    if recipe == "gpt":
        return [m for m in model.modules() if isinstance(m, gpt.Block)]
    names: set[str] = set()
    for m in model.modules():
        no_split = getattr(m, "_no_split_modules", None)
        if isinstance(no_split, list | tuple | set):
            names.update(str(n) for n in no_split)
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(model: nn.Module, recipe: str, device: torch.device) -> int:
    """`fully_shard` per layer, then the root, on a 1-D mesh of every rank (in place);
    returns the number of units (the root included)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    units = shard_units(model, recipe)
    if not units:
        log.warning("no decoder layers found in %s: the whole model is one FSDP unit", type(model).__name__)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return len(units) + 1


def held_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the parameters this rank holds, bytes of the whole model's): equal unless sharded."""
    local = whole = 0
    for p in model.parameters():
        local += local_tensor(p).numel() * p.element_size()
        whole += p.numel() * p.element_size()  # a DTensor's numel is the whole tensor's
    return local, whole
