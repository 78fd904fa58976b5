"""One rank of a 2-rank job (run under torchrun by test_dcp_resharding.py): loads the checkpoint
that one rank wrote in SRC (1 -> 2) and checks its rows of every optimizer tensor against the
whole tensors in SRC-ref.safetensors; trains on and writes its own checkpoint in OUT, with its
rows of every optimizer tensor in OUT-ref-rank<k>.safetensors (for the test's 2 -> 1 load)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from fedtrain.participant.local.dcp_checkpoint import DcpCheckpoint
from fedtrain.participant.ranks.shards import chunk_rows
from tests.helpers.dcp import optimizer_tensors, sharded, train
from tests.helpers.workers import end_at_once


def rows(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s rows of the whole tensor `t` (a 0-dim tensor is whole on every rank)."""
    if t.dim() == 0:
        return t
    start, stop = chunk_rows(t.shape[0], world, rank)
    return t[start:stop]


def main(src: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = sharded()
    record = DcpCheckpoint(src, model).load(opt)
    want = load_file(f"{src}-ref.safetensors")
    got = optimizer_tensors(model, opt)
    wrong = [n for n, t in got.items() if not torch.equal(t, rows(want[n], world, rank))]
    train(model, opt, 2, seed=10 + rank)
    DcpCheckpoint(out, model).save(round_=7, optimizer=opt, steps=9, user_state={"rank": rank})
    mine = {n: t.contiguous() for n, t in optimizer_tensors(model, opt).items()}
    save_file(mine, f"{out}-ref-rank{rank}.safetensors")
    report = {"record": record, "wrong": wrong, "checked": len(got)}
    (out.parent / f"loaded-rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    end_at_once()
