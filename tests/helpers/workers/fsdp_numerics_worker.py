"""One rank of a 2-rank FSDP2 participant for the numerics checks (run under torchrun by
test_fsdp_numerics.py): the built-in GPT, `fully_shard` per block then the root, inner AdamW,
trained on batches drawn from a seed (`global_batch`) so that the test's single-process
participant and its pure-torch reference see the very same tokens: rank k takes rows
[k*b, (k+1)*b) of each global batch of 2b rows.

argv: OUT, then one or more PHASE=url,name,seed,optimizer (adamw | sgd): the phases run one after the other, each a
fresh model, optimizer and participant of its own coordinator. Writes OUT/<name>-rank<k>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from fedtrain.config import RunConfig
from fedtrain.participant import CoordinatorClient, Participant
from fedtrain.recipes.build import build_model
from tests.helpers.workers import end_at_once

ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
"""The inner AdamW's arguments (besides the run's lr), on both sides of every comparison."""
SGD = {"lr": 0.5, "momentum": 0.9}
"""The inner SGD's: linear in the gradients, so float rounding is not amplified (see the test)."""


def inner_optimizer(model: torch.nn.Module, kind: str, lr: float) -> torch.optim.Optimizer:
    """The inner optimizer `kind` ("adamw": the run's lr; "sgd": SGD's own) over `model`."""
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), **SGD)  # type: ignore[arg-type]
    return torch.optim.AdamW(model.parameters(), lr=lr, **ADAMW)  # type: ignore[arg-type]


def global_batch(gen: torch.Generator, rows: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The next (x, y) of `rows` sequences, drawn from `gen`: y is x shifted by one token."""
    tokens = torch.randint(0, vocab, (rows, seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def run_phase(url: str, name: str, seed: int, optimizer: str, out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    client = CoordinatorClient(url, os.environ["FEDTRAIN_TOKEN"])
    cfg = RunConfig.model_validate(client.get_config()["config"])
    model = build_model(cfg.model, seed=1)  # any weights: the global model is loaded at join
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)
    opt = inner_optimizer(model, optimizer, cfg.train.lr)
    gen = torch.Generator().manual_seed(seed)
    b = cfg.train.batch_size
    with Participant(client, model=model, name=name, keepalive_s=0.5) as fed:
        while not fed.finished:
            x, y = global_batch(gen, world * b, cfg.train.seq_len, cfg.model.vocab_size)
            x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            fed.step(tokens=x.numel(), loss=float(loss))
    report = {"participant_id": fed.participant_id, "steps": fed.steps, "tokens": fed.tokens,
              "round": fed.round, "shard_bytes": fed.shard_bytes, "history": fed.history}
    (out / f"{name}-rank{rank}.json").write_text(json.dumps(report))


def main(out: Path, phases: list[str]) -> None:
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    try:
        for phase in phases:
            url, name, seed, optimizer = phase.split(",")
            run_phase(url, name, int(seed), optimizer, out)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
    end_at_once()
