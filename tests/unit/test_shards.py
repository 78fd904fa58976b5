"""The rows of a tensor an FSDP2 rank holds (`participant/shards.py`): torch.chunk's split of dim 0."""

from __future__ import annotations

import torch
from torch import nn

from fedtrain.participant.shards import Shard, chunk_rows, is_sharded, shard_layout


def test_chunk_rows_are_torch_chunk_rows_even_when_uneven_or_empty() -> None:
    for n in (0, 1, 2, 3, 5, 7, 64, 65):
        for world in (1, 2, 3, 4, 8):
            chunks = torch.arange(n).chunk(world) if n else ()
            for rank in range(world):
                start, stop = chunk_rows(n, world, rank)
                got = torch.arange(n)[start:stop]
                want = chunks[rank] if rank < len(chunks) else torch.arange(0)
                assert torch.equal(got, want), (n, world, rank)


def test_a_plain_module_is_held_whole() -> None:
    model = nn.Linear(3, 5)
    params = dict(model.named_parameters())
    assert not is_sharded(params)
    assert shard_layout(params) == {"weight": Shard(0, 5, whole=True), "bias": Shard(0, 5, whole=True)}
    assert Shard(0, 5, whole=True).rows() is None and Shard(2, 2, whole=False).empty
