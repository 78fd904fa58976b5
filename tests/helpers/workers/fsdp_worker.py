"""One rank of a 2-rank FSDP2 participant (run under torchrun by test_fsdp*.py): the built-in GPT,
`fully_shard` per block then the root, trained on stdlib:0/2 (each rank its own batches);
writes its rows of the final weights and its history to OUT/rank<k>.*

    fsdp_worker.py URL NAME OUT [--key-file F] [--attempt-s S] [--budget-s S] [--speed X]

Each rank also records the config changes its `on_config_change` callback saw (round, config
version, train.lr, the changed fields)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard

from fedtrain import faults
from fedtrain.config import RunConfig
from fedtrain.participant import CoordinatorClient, Participant
from fedtrain.participant.engine.outage import OutagePolicy
from fedtrain.participant.ranks.shards import local_tensor, shard_layout
from fedtrain.recipes.build import build_model
from fedtrain.recipes.data import TokenStream, load_tokens, parse_data_spec
from tests.helpers.workers import end_at_once, train_step


def main(url: str, name: str, out: Path, key_file: Path | None, outage: OutagePolicy, speed: float) -> None:
    faults.arm_from_env()  # FEDTRAIN_FAULTS: kill a rank at a named point
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    client = CoordinatorClient(url, os.environ["FEDTRAIN_TOKEN"])
    cfg = RunConfig.model_validate(client.get_config()["config"])
    model = build_model(cfg.model, seed=1)  # any weights: the global model is loaded at join
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    data = TokenStream(load_tokens(parse_data_spec("stdlib:0/2")), batch_size=cfg.train.batch_size,
                       seq_len=cfg.train.seq_len, seed=100 + rank)
    sent_and_trained_on = 0
    changes: list[dict] = []
    with Participant(client, model=model, name=name, keepalive_s=1.0, key_file=key_file, outage=outage,
                     inner_optimizer=opt, speed=speed) as fed:

        @fed.on_config_change
        def seen(old: RunConfig, new: RunConfig, diff: dict) -> None:
            changes.append({"round": fed.round, "version": fed.config_version, "lr": new.train.lr,
                            "fields": sorted(diff)})

        while not fed.finished:
            tokens, loss = train_step(model, opt, data)
            if fed.step(tokens=tokens, loss=loss) and fed.sync_in_flight:
                sent_and_trained_on += 1  # an overlapped sync: sent, and back to training at once
    layout = shard_layout(dict(model.named_parameters()))
    mine = {n: local_tensor(p).detach().clone() for n, p in model.named_parameters() if not layout[n].empty}
    rows = {n: [layout[n].start, layout[n].stop] for n in mine}
    save_file(mine, str(out / f"rank{rank}.safetensors"), metadata={"rows": json.dumps(rows)})
    (out / f"rank{rank}.json").write_text(json.dumps({"history": fed.history, "shard_bytes": fed.shard_bytes,
                                                      "participant_id": fed.participant_id, "outages": fed.outages,
                                                      "bytes_up": fed.bytes_up,
                                                      "overlapped": sent_and_trained_on,
                                                      "config_changes": changes}))
    dist.destroy_process_group()


if __name__ == "__main__":
    cli = argparse.ArgumentParser()
    cli.add_argument("url")
    cli.add_argument("name")
    cli.add_argument("out", type=Path)
    cli.add_argument("--key-file", type=Path, default=None)
    cli.add_argument("--attempt-s", type=float, default=10.0)
    cli.add_argument("--budget-s", type=float, default=None)
    cli.add_argument("--speed", type=float, default=1.0)
    a = cli.parse_args()
    main(a.url, a.name, a.out, a.key_file, OutagePolicy(budget_s=a.budget_s, attempt_s=a.attempt_s,
                                                       backoff_initial_s=0.2, backoff_max_s=1.0), a.speed)
    end_at_once()
