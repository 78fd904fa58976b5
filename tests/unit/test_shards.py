"""The rows of a tensor an FSDP2 rank holds (`participant/ranks/shards.py`): torch.chunk's split of dim 0."""

from __future__ import annotations

import torch
from torch import nn

from fedtrain.participant.ranks.shards import Shard, chunk_rows, is_sharded, shard_layout


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


def test_participant_given_a_sharded_model_is_an_fsdp_participant_syncing_its_rows(tmp_path) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from fedtrain import Participant
    from fedtrain.participant.ranks.roles import piece_of

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
        fully_shard(model[0])
        fully_shard(model)
        params = dict(model.named_parameters())
        assert is_sharded(params)
        fed = Participant("http://127.0.0.1:9", token="t", model=model, name="site")
        assert type(fed) is Participant and fed.role.kind == "sharded"
        assert fed.info == {"parallel": "fsdp", "world_size": 1}
        piece = piece_of(0, params, shard_layout(params))
        assert piece.label == "rank0" and piece.sends == frozenset(params)
        assert piece.rows_of(["0.weight"]) == {"0.weight": [0, 6]}
        assert piece.shapes["1.weight"] == (torch.float32, (3, 6))
        plain = Participant("http://127.0.0.1:9", token="t", model=nn.Linear(2, 2))
        assert type(plain) is Participant
    finally:
        dist.destroy_process_group()
