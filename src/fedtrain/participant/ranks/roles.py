"""How the ranks of a participant share its sync: the ranks strategy of the one engine.

- **single**: one process. It speaks HTTP; its engine holds the sync set.
- **replicated**: a DDP group, a replica per rank. Rank 0 speaks HTTP and holds the engine; after a
  round lands, the new weights (what changed) are broadcast from rank 0 on the training group.
- **sharded**: an FSDP2 group (`fully_shard`). Every rank speaks HTTP for its own rows, sent as its
  piece of the update (`PieceOf`), and downloads only its rows: nothing is broadcast.

`role_for` picks one from the model and the process group. See docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

from fedtrain.participant.client.coordinator_client import CoordinatorClient
from fedtrain.participant.engine.sync import SyncEngine
from fedtrain.participant.engine.sync_set import PieceOf
from fedtrain.participant.ranks.control import RankGroup
from fedtrain.participant.ranks.shards import Shard, is_sharded, local_tensor, reshard, shard_layout

__all__ = ["Role", "piece_of", "role_for", "sync_set"]

Kind = Literal["single", "replicated", "sharded"]


def sync_set(model: nn.Module) -> dict[str, nn.Parameter]:
    """The tensors that travel: the model's trainable parameters, by name."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


class _LocalShards(Mapping[str, torch.Tensor]):
    """name -> this rank's local tensor of that parameter, looked up on each use."""

    def __init__(self, params: Mapping[str, nn.Parameter], names: list[str]) -> None:
        self._params = params
        self._names = names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return local_tensor(self._params[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def piece_of(rank: int, params: Mapping[str, nn.Parameter], layout: Mapping[str, Shard]) -> PieceOf:
    """What rank `rank` sends: its rows of each sharded tensor, and (rank 0) the replicated ones."""
    held = {n: s for n, s in layout.items() if not s.empty}
    return PieceOf(
        label=f"rank{rank}",
        sends=frozenset(n for n, s in held.items() if rank == 0 or not s.whole),
        rows={n: (s.start, s.stop) for n, s in held.items() if not s.whole},
        shapes={n: (p.dtype, tuple(p.shape)) for n, p in params.items()},  # a DTensor's shape is global
    )


class Role:
    """One rank's part in its participant's sync (see the module docstring)."""

    def __init__(self, kind: Kind, model: nn.Module, ranks: RankGroup) -> None:
        self.kind = kind
        self.model = model
        self.ranks = ranks
        self.params = sync_set(model)
        self._names = sorted(self.params)

    @property
    def info(self) -> dict[str, Any]:
        """What the join tells the coordinator of the group (`coordinator/ranks.py`)."""
        if self.kind == "single":
            return {}
        return {"parallel": "fsdp" if self.kind == "sharded" else "ddp", "world_size": self.ranks.world_size}

    @property
    def speaks(self) -> bool:
        """Whether this rank uploads and downloads (has an engine)."""
        return self.kind == "sharded" or self.ranks.lead

    @property
    def pieces(self) -> bool:
        """Whether the update travels as the ranks' pieces: every attempt at a round then carries
        the first attempt's token count (the pieces of one update carry one count)."""
        return self.kind == "sharded"

    @property
    def evaluates_everywhere(self) -> bool:
        """Whether `eval_fn` runs on every rank (an FSDP forward is collective), averaged; else
        on rank 0, and its result is told to the others."""
        return self.kind == "sharded"

    def engine(self, client: CoordinatorClient, *, who: str, patience_s: float,
               keepalive_s: float) -> SyncEngine | None:
        """This rank's `SyncEngine`, or None on a rank that does not speak HTTP."""
        if not self.speaks:
            return None
        if self.kind != "sharded":
            return SyncEngine(client, self.params, who=who, patience_s=patience_s)
        layout = shard_layout(self.params)
        held = sorted(n for n, s in layout.items() if not s.empty)
        engine = SyncEngine(client, _LocalShards(self.params, held), who=f"{who}.rank{self.ranks.rank}",
                            patience_s=patience_s, piece=piece_of(self.ranks.rank, self.params, layout))
        engine.wait_s = max(1.0, min(25.0, 2 * keepalive_s))  # a rank's failure cuts our wait this soon
        return engine

    def settle(self) -> None:
        """Before a sync or after an eval: a sharded model's modules back in their sharded state
        (the shards are what we send and what the new weights go into)."""
        if self.kind == "sharded":
            reshard(self.model)

    def landed(self, changed: list[str] | None) -> None:
        """New weights are in rank 0's model: a replicated group's other ranks take them (the
        tensors `changed`, in name order; None: the whole sync set)."""
        if self.kind != "replicated":
            return
        names = self._names if changed is None else sorted(changed)
        self.ranks.broadcast_tensors(self.params[n].data for n in names)


def role_for(model: nn.Module, ranks: RankGroup) -> Role:
    """The role of this rank: a sharded model is sharded, several ranks are replicated, else single."""
    if is_sharded(sync_set(model)):
        return Role("sharded", model, ranks)
    return Role("replicated" if ranks.world_size > 1 else "single", model, ranks)
