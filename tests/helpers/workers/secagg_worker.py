"""A participant under secure aggregation that keeps what it sent (run by test_secagg_fsdp.py):
under torchrun a 2-rank FSDP2 group (the built-in GPT, `fully_shard` per block then the root),
alone a single process; trains on stdlib data (each process its own batches) and writes, for
each round it syncs, its rows of the model it synced (θ_local) to OUT/NAME-rank<k>-round<r>.safetensors,
and at the end its rows to OUT/NAME-rank<k>-final.safetensors

    secagg_worker.py URL NAME OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard

from fedtrain.config import RunConfig
from fedtrain.participant import CoordinatorClient, Participant
from fedtrain.participant.ranks.shards import local_tensor, shard_layout
from fedtrain.recipes.build import build_model
from fedtrain.recipes.data import TokenStream, load_tokens, parse_data_spec
from tests.helpers.workers import end_at_once, train_step


def main(url: str, name: str, out: Path) -> None:
    group = "WORLD_SIZE" in os.environ
    if group:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if group else 0
    client = CoordinatorClient(url, os.environ["FEDTRAIN_TOKEN"])
    cfg = RunConfig.model_validate(client.get_config()["config"])
    model = build_model(cfg.model, seed=1)  # any weights: the global model is loaded at join
    if group:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    data = TokenStream(load_tokens(parse_data_spec("stdlib:0/2")), batch_size=cfg.train.batch_size,
                       seq_len=cfg.train.seq_len, seed=(100 if group else 200) + rank)
    def rows_now() -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:  # this rank's rows of the model
        params = dict(model.named_parameters())
        layout = shard_layout(params) if group else None
        mine = {n: local_tensor(p).detach().clone() for n, p in params.items() if layout is None or not layout[n].empty}
        return mine, {n: [layout[n].start, layout[n].stop] if layout is not None else [0, t.shape[0]]
                      for n, t in mine.items()}

    def save(what: str, rows: tuple[dict[str, torch.Tensor], dict[str, list[int]]]) -> None:
        save_file(rows[0], str(out / f"{name}-rank{rank}-{what}.safetensors"), metadata={"rows": json.dumps(rows[1])})

    with Participant(client, model=model, name=name, keepalive_s=1.0, inner_optimizer=opt) as fed:
        save(f"start{fed.round}", rows_now())
        while not fed.finished:
            tokens, loss = train_step(model, opt, data)
            r, sent = fed.round, rows_now()
            if fed.step(tokens=tokens, loss=loss):  # the step synced: `sent` is what went
                save(f"round{r}", sent)
                if not fed.finished:
                    save(f"start{fed.round}", rows_now())  # the global rows the next round starts from
        save("final", rows_now())  # where the run left this rank: the global rows
    if group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
    end_at_once()
