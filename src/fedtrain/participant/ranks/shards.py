"""Which rows of each tensor of the sync set this rank holds, under FSDP2 (`fully_shard`).

`fully_shard` turns each parameter into a `DTensor` placed `Shard(0)` on a 1-D mesh: the
rows of a tensor of n rows are split as `torch.chunk` splits them, so with c = ceil(n / w)
rank i of w holds rows [min(i*c, n), min((i+1)*c, n)) (the last ranks may hold fewer, or
none: a tensor of 1 row on 2 ranks lives on rank 0 alone). FSDP's padding is internal:
`to_local()` is exactly those rows, which `shard_layout` checks, so a future change of
layout fails loudly instead of sending wrong rows. A parameter that is not a DTensor is
held whole by every rank (replicated); rank 0 alone sends it.

Pure functions over the model's parameters: no collective, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fedtrain.errors import FedtrainError

__all__ = ["Shard", "chunk_rows", "is_sharded", "local_tensor", "reshard", "shard_layout"]


@dataclass(frozen=True)
class Shard:
    """One tensor of the sync set as this rank holds it: rows [start, stop) of dimension 0
    (`whole`: every row, and no DTensor: a replicated parameter)."""

    start: int
    stop: int
    whole: bool

    @property
    def empty(self) -> bool:
        return self.stop <= self.start

    def rows(self) -> list[int] | None:
        """The `[start, stop]` an update piece and a row download name (None: the whole tensor)."""
        return None if self.whole else [self.start, self.stop]


def chunk_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of n that rank `rank` of `world` holds when split as `torch.chunk` does."""
    per = -(-n // world) if n else 0
    start = min(rank * per, n)
    return start, min(start + per, n)


def _dtensor_cls() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def is_sharded(params: Mapping[str, nn.Parameter]) -> bool:
    """Whether any parameter is a DTensor (the model went through `fully_shard`)."""
    cls = _dtensor_cls()
    return cls is not None and any(isinstance(p, cls) for p in params.values())


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's rows of `p` (its DTensor shard, or `p` itself), sharing `p`'s storage."""
    cls = _dtensor_cls()
    return p.to_local() if cls is not None and isinstance(p, cls) else p  # type: ignore[attr-defined]


def reshard(model: nn.Module) -> None:
    """Put every `fully_shard`ed module of `model` back in its sharded state.

    FSDP2 keeps the root module's parameters gathered after a forward that no backward
    follows (an evaluation), and the module then holds the unsharded parameters in place of
    the sharded ones until its next backward: the optimizer's (sharded) parameters are not
    the model's, and a sharded checkpoint of the optimizer fails. Worse for a sync, the
    next forward would use the gathered copy, not the new global weights loaded into the
    shards. A no-op on modules already sharded."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def shard_layout(params: Mapping[str, nn.Parameter]) -> dict[str, Shard]:
    """The rows this rank holds of every parameter, checked against its local tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard as ShardPlacement

    layout: dict[str, Shard] = {}
    for name, p in params.items():
        if not isinstance(p, DTensor):
            layout[name] = Shard(0, p.shape[0] if p.dim() else 1, whole=True)
            continue
        mesh, placements = p.device_mesh, p.placements
        if mesh.ndim != 1 or len(placements) != 1 or placements[0] != ShardPlacement(0) or p.dim() == 0:
            raise FedtrainError(f"{name}: only parameters sharded on dimension 0 of a 1-D mesh (fully_shard) can "
                                f"be synced by shard, not {placements} on a {mesh.ndim}-D mesh")
        coordinate = mesh.get_local_rank()
        start, stop = chunk_rows(p.shape[0], mesh.size(), coordinate)
        local = p.to_local()
        if tuple(local.shape) != (stop - start, *p.shape[1:]):
            raise FedtrainError(f"{name}: rank {coordinate} of {mesh.size()} holds a shard of shape "
                                f"{tuple(local.shape)}, not rows [{start}, {stop}) of {tuple(p.shape)}")
        layout[name] = Shard(start, stop, whole=False)
    return layout
