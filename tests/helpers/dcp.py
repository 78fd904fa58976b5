"""DCP checkpoint tests' pieces: torch.distributed as a gloo group of one in this process, a
tiny GPT sharded with FSDP2, a few training steps, and every optimizer tensor by name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from fedtrain.config import ModelConfig
from fedtrain.participant.ranks.shards import local_tensor
from fedtrain.recipes.build import build_model
from fedtrain.recipes.sharding import shard_model

TINY = {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16}


@contextlib.contextmanager
def gloo_of_one() -> Iterator[None]:
    """torch.distributed in this process, as the only rank of a gloo group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(**model: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    m = build_model(ModelConfig.model_validate({**TINY, **model}), seed=0)
    shard_model(m, "gpt", torch.device("cpu"))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 8), generator=g)
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def optimizer_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's part of every optimizer tensor, named `<parameter>/<key>` (the same on any world size)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, opt)
    return {f"{fqn}/{key}": local_tensor(v).clone() for fqn, entry in sd["state"].items()
            for key, v in entry.items() if isinstance(v, torch.Tensor)}
