"""What a sync engine works over, besides the whole sync set: a rank's piece of the update
(`PieceOf`, an FSDP rank's rows) and a fragment's tensors (`Only`, Streaming DiLoCo).

More: docs/architecture.md, "participant/engine/sync.py".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class PieceOf:
    """What one rank of a sharded participant syncs: `label` names its piece of the update;
    it sends the tensors in `sends` (rows `rows[name]` of those sharded, the others whole)
    and fetches every tensor of the engine's params (the same rows). `shapes` is the whole
    model's (dtype, shape) per tensor, which the run's model is checked against at join."""

    label: str
    sends: frozenset[str]
    rows: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    shapes: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)

    def rows_of(self, names: Any) -> dict[str, list[int] | None]:
        """`{name: [start, stop] or None (whole)}` for `names`, as uploads and downloads name them."""
        return {n: list(self.rows[n]) if n in self.rows else None for n in names}


class Only(Mapping[str, torch.Tensor]):
    """`params` restricted to `names`, each looked up on use (an FSDP rank's local shards are)."""

    def __init__(self, params: Mapping[str, torch.Tensor], names: list[str]) -> None:
        self._params = params
        self._names = list(names)
        self._known = frozenset(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        return self._params[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
