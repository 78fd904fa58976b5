"""The recipe's participant: the run's model (built-in GPT or a Hugging Face causal LM, with
optional LoRA) trained on local text, synced by fedtrain.

A short, readable loop on the public API only (`Participant`, the recipe's model and data):
copy it to start a training script of your own. The same loop runs alone or as every rank
of a torchrun group (`torchrun --nproc_per_node N -m fedtrain participant ...`): with
`parallel="ddp"` rank 0 talks to the coordinator and DDP keeps the ranks in step; with
`parallel="fsdp"` the model is `fully_shard`ed (`sharding.py`) and every rank syncs its own
rows. With a run directory the loop resumes from its last round boundary after a restart
(with FSDP, on any number of ranks) and logs its metrics there.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from fedtrain.config import RunConfig, TrainConfig
from fedtrain.errors import ConfigError
from fedtrain.participant import CoordinatorClient, RetryPolicy
from fedtrain.participant.engine.pace import check_speed
from fedtrain.participant.ranks.torchrun import init_from_env
from fedtrain.recipes.build import base_fingerprint, build_model, check_fits, load_data, loss_fn, tokenizer_of
from fedtrain.recipes.data import TokenStream, evaluate, parse_data_spec
from fedtrain.recipes.runtime import RunDir, open_participant, round_line
from fedtrain.recipes.sharding import PARALLEL, held_bytes, init_fsdp, shard_model

log = logging.getLogger("fedtrain.recipe")


def _seed_of(name: str | None) -> int:
    return int.from_bytes(hashlib.blake2b((name or "anon").encode(), digest_size=4).digest(), "little")


def run_participant(
    url: str,
    token: str,
    data: str,
    *,
    name: str | None = None,
    threads: int = 1,
    verify: bool | str = True,
    max_steps: int | None = None,
    retry: RetryPolicy = RetryPolicy(),
    run_dir: Path | None = None,
    device: str = "cpu",
    parallel: str = "ddp",
    speed: float = 1.0,
) -> dict[str, Any]:
    """Join the run at `url`, train on `data` until the run finishes; returns a summary.

    Under torchrun every rank calls this; `run_dir` keeps the checkpoint and metrics.
    `parallel`: "ddp" (a replica per rank) or "fsdp" (the model sharded over the ranks). `speed`
    below 1 runs the inner steps at that fraction of their natural pace (a slow site on purpose)."""
    if parallel not in PARALLEL:
        raise ConfigError(f"parallel must be one of {', '.join(PARALLEL)}, not {parallel!r}")
    check_speed(speed)  # a bad throttle fails here, before any network call
    fsdp = parallel == "fsdp"
    torch.set_num_threads(threads)
    paths = parse_data_spec(data)  # bad data fails here, before any network call
    rank, world, dev = init_fsdp(device) if fsdp else init_from_env(device)
    try:
        return _train(url, token, paths, data, name=name, verify=verify, max_steps=max_steps,
                      retry=retry, run_dir=run_dir, parallel=parallel, speed=speed, rank=rank, world=world, dev=dev)
    finally:  # on every way out (a SIGTERM too): with the interpreter still whole, not in its teardown
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _train(url: str, token: str, paths: list[Path], data: str, *, name: str | None, verify: bool | str,
           max_steps: int | None, retry: RetryPolicy, run_dir: Path | None, parallel: str,
           speed: float, rank: int, world: int, dev: torch.device) -> dict[str, Any]:
    fsdp = parallel == "fsdp"
    client = CoordinatorClient(url, token, verify=verify, retry=retry)
    cfg = RunConfig.model_validate(client.get_config()["config"])
    tokenizer = tokenizer_of(cfg.model)
    tokens = load_data(cfg.model, paths, tokenizer)
    seed = _seed_of(name) + rank  # every rank draws its own batches
    stream = TokenStream(tokens, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=seed)
    model = build_model(cfg.model, seed=cfg.seed)
    check_fits(model, cfg.model, cfg.train.seq_len, tokenizer)
    model.to(dev)
    info = {"world_size": world, "base": base_fingerprint(model) if cfg.model.lora else None}  # of the whole base
    if fsdp:
        shard_model(model, cfg.model.recipe, dev)  # before the optimizer: its parameters are the DTensors
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    compute_loss = loss_fn(cfg.model)

    def eval_fn(m: torch.nn.Module) -> dict[str, float]:
        loss = evaluate(m, stream.eval_batches(cfg.train.eval_batches), compute_loss)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}

    local = None
    if run_dir is not None:
        from fedtrain.participant.local.dcp_checkpoint import DcpCheckpoint  # torch.distributed.checkpoint: FSDP only

        local = RunDir(run_dir, rank, checkpoint=DcpCheckpoint(run_dir / "dcp", model) if fsdp else None)
    saved = local.resume(opt, stream, cfg.train.lr) if local is not None else None
    log.info("%s: %d training tokens from %s (rank %d of %d)", name or "participant", tokens.numel(), data, rank, world)
    t0 = time.perf_counter()
    key_file = run_dir / "participant-key.json" if run_dir is not None and rank == 0 else None  # only rank 0 joins
    fed, net = open_participant(client, model, opt, eval_fn, name=name, info=info, world_size=world, device=dev,
                                key_file=key_file, parallel=parallel, speed=speed)
    with fed:
        if local is not None and saved is not None:
            local.restore_counters(fed, saved)
        while not fed.finished and (max_steps is None or fed.steps < max_steps):
            stream.batch_size = fed.config.train.batch_size  # live: changes apply at round boundaries
            x, y = stream.next_batch()
            x, y = x.to(dev), y.to(dev)
            loss = compute_loss(net, x, y)
            loss.backward()
            if cfg.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(trainable, cfg.train.grad_clip)
            warm_up(opt, fed.steps, fed.config.train)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if fed.step(tokens=x.numel(), loss=loss.item()):
                if local is not None:
                    local.after_sync(fed, opt, stream)
                if fed.history and rank == 0:
                    log.info("%s", round_line(fed.history[-1]))
        history = fed.history
        local_bytes, model_bytes = held_bytes(model)
        summary = {
            "participant": fed.participant_id,
            "rank": rank,
            "world_size": world,
            "parallel": parallel,
            "param_bytes": local_bytes,  # of the model's parameters (frozen too) on this rank; all of them,
            "model_param_bytes": model_bytes,  # unless sharded
            "steps": fed.steps,
            "tokens": fed.tokens,
            "rounds": len(history),
            "bytes_up": fed.bytes_up,
            "bytes_down": fed.bytes_down,
            "bytes_up_per_round": history[-1].get("bytes_up") if history else None,
            "wall_s": round(time.perf_counter() - t0, 2),
            "sync_s": round(fed.sync_seconds, 2),
            "final_round": fed.round,
            "speed": speed,
            "resumed_from_round": saved["round"] if saved else None,
        }
    if local is not None:
        summary["final_weights"] = str(local.finish(model))
        local.close()
    return summary


def warm_up(opt: torch.optim.Optimizer, steps_done: int, train: TrainConfig) -> None:
    """The lr of the next inner step under `train.warmup_steps`: `lr` x (steps_done + 1) / k over
    the first k steps; `lr` itself at step k (after it, a live change of `train.lr` sets it)."""
    k = train.warmup_steps
    if steps_done > k:
        return
    lr = train.lr * min(1.0, (steps_done + 1) / k) if k > 0 else train.lr
    for group in opt.param_groups:
        group["lr"] = lr
