"""Plumbing of the recipe's participant loop: one process or a torchrun group, and its run directory.

`open_participant` gives the loop what it needs whether it runs alone or as one rank of
a torchrun group: the `Participant` to call `step` on (the same on every rank) and the module
to run forward and backward through (the model, its `DistributedDataParallel` wrapper, or the
`fully_shard`ed model itself).

`RunDir` is the participant's local directory: the checkpoint written at every round
boundary and restored at start (inner optimizer state, upload residual, data position,
counters), the
per-round metrics (JSON lines, TensorBoard when installed) and, at the end, the final
weights of the sync set. Under torchrun rank 0 owns `DIR/`; with DDP rank k keeps its own
checkpoint (its data position) in `DIR/rank-k/`. With FSDP the checkpoint is one
`DcpCheckpoint` in `DIR/dcp/` written by every rank (sharded optimizer state, each rank's
data position, rank 0's counters), which loads on another number of ranks too, and each
rank writes its own rows of the final weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from fedtrain.errors import ModelMismatchError
from fedtrain.participant import CoordinatorClient, Participant
from fedtrain.participant.engine.records import EvalFn
from fedtrain.participant.local.checkpoint import LocalCheckpoint
from fedtrain.participant.local.metrics_log import MetricsLog
from fedtrain.participant.ranks.roles import sync_set
from fedtrain.participant.ranks.shards import is_sharded, local_tensor, shard_layout
from fedtrain.recipes.data import TokenStream
from fedtrain.wire import write_file
from fedtrain.wire.format import ROWS_META

__all__ = ["RoundCheckpoint", "RunDir", "open_participant", "round_line"]

log = logging.getLogger("fedtrain.recipe")


class RoundCheckpoint(Protocol):
    """What `RunDir` keeps at round boundaries: `LocalCheckpoint` (one process or rank) or
    `DcpCheckpoint` (every rank of an FSDP participant together)."""

    def save(self, *, round_: int, optimizer: torch.optim.Optimizer, steps: int = 0, tokens: int = 0,
             user_state: dict[str, Any] | None = None) -> Any: ...

    def load(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None: ...


def open_participant(
    client: CoordinatorClient,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    eval_fn: EvalFn,
    *,
    name: str | None,
    info: dict[str, Any],
    world_size: int,
    device: torch.device,
    key_file: Path | None = None,
    parallel: str = "ddp",
    speed: float = 1.0,
) -> tuple[Participant, nn.Module]:
    """(the participant to step, the module to train through) for one process or a torchrun group.
    `key_file` keeps the participant key, so that a restarted process rejoins as itself at once.
    `parallel="fsdp"`: `model` is `fully_shard`ed and every rank syncs its own rows. `speed`
    below 1 throttles its inner steps (a slow site on purpose: `participant/engine/pace.py`)."""
    fed = Participant(client, model=model, inner_optimizer=optimizer, eval_fn=eval_fn, name=name, info=info,
                      key_file=key_file, speed=speed)
    if parallel == "fsdp" or world_size <= 1:
        return fed, model
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return fed, DistributedDataParallel(model, device_ids=ids)


class RunDir:
    """A participant's local directory (see the module docstring); one per participant name."""

    def __init__(self, directory: str | Path, rank: int = 0, checkpoint: RoundCheckpoint | None = None) -> None:
        self.dir = Path(directory)
        self.rank = rank
        own = self.dir if rank == 0 else self.dir / f"rank-{rank}"
        self.checkpoint: RoundCheckpoint = checkpoint if checkpoint is not None else LocalCheckpoint(own / "checkpoint")
        self.metrics = MetricsLog(self.dir) if rank == 0 else None
        self._up = self._down = 0

    def resume(self, optimizer: torch.optim.Optimizer, stream: TokenStream, lr: float) -> dict[str, Any] | None:
        """Restore the inner optimizer and the data position of the last round boundary, if any."""
        saved = self.checkpoint.load(optimizer)
        if saved is None:
            return None
        for group in optimizer.param_groups:
            group["lr"] = lr  # the run's config (possibly changed live) wins over the saved one
        data = saved["user_state"].get("data")
        if data is not None:
            stream.load_state_dict(data)
        else:  # a rank the checkpoint's world did not have (FSDP on more ranks than before)
            log.info("rank %d: no saved data position, its data stream starts fresh", self.rank)
        log.info(
            "resumed the local checkpoint of round %d (%d batches drawn, %d steps)",
            saved["round"],
            stream.position,
            saved["steps"],
        )
        return saved

    def restore_counters(self, fed: Participant, saved: dict[str, Any]) -> None:
        """After the participant joined again: its counters and its upload residual."""
        fed.steps, fed.tokens = int(saved["steps"]), int(saved["tokens"])
        residual = self.checkpoint.load_residual() if isinstance(self.checkpoint, LocalCheckpoint) else None
        if residual:
            try:
                fed.restore_upload_residual(residual)
                log.info("resumed the upload residual of round %d (%d tensors)", saved["round"], len(residual))
                return
            except ModelMismatchError as e:
                log.warning("the saved upload residual does not fit this model (%s)", e.message)
        t = fed.config.train
        local = isinstance(self.checkpoint, LocalCheckpoint)
        if t.compression != "none" and t.error_feedback and (self.rank == 0 or not local):  # (DDP: rank 0 uploads)
            log.info("rank %d: no saved upload residual: the upload error feedback starts from zero%s", self.rank,
                     "" if local else " (an FSDP checkpoint does not keep it)")

    def after_sync(self, fed: Participant, optimizer: torch.optim.Optimizer, stream: TokenStream) -> None:
        """At a round boundary: write the checkpoint and the round's metrics."""
        self.checkpoint.save(
            round_=fed.round,
            optimizer=optimizer,
            steps=fed.steps,
            tokens=fed.tokens,
            user_state={"data": stream.state_dict()},
            **({"residual": fed.upload_residual()} if isinstance(self.checkpoint, LocalCheckpoint) else {}),
        )
        if self.metrics is not None and fed.history:
            self.metrics.write(fed.history[-1])

    def finish(self, model: nn.Module) -> Path:
        """Write this rank's final weights of the sync set; returns the file. A sharded model's
        rank writes only its rows, named in the metadata `fedtrain.rows` ({name: [start, stop]})."""
        params = sync_set(model)
        sharded = is_sharded(params)
        name = "final.safetensors" if self.rank == 0 and not sharded else f"final-rank{self.rank}.safetensors"
        path = self.dir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = {"written_by": "fedtrain participant"}
        if sharded:
            layout = shard_layout(params)
            mine = [n for n, s in layout.items() if not s.empty]
            tensors = {n: local_tensor(params[n]).detach().to("cpu") for n in mine}
            meta[ROWS_META] = json.dumps({n: [layout[n].start, layout[n].stop] for n in mine})
        else:
            tensors = {n: p.detach().to("cpu") for n, p in params.items()}
        write_file(path, tensors, meta)
        return path

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def round_line(record: dict[str, Any]) -> str:
    """A one-line summary of a round record, for the log."""
    parts = [f"round {record['round']}: train loss {record.get('train_loss', float('nan')):.3f}"]
    if "eval_before/loss" in record:
        parts.append(f"eval {record['eval_before/loss']:.3f} -> {record.get('eval_after/loss', float('nan')):.3f}")
    parts.append(f"up {record.get('bytes_up', 0):,} B, down {record.get('bytes_down', 0):,} B")
    parts.append(f"sync {record['sync_s']:.2f}s")
    return ", ".join(parts)
