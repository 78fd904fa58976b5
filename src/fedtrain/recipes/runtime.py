"""Plumbing of the recipe's participant loop: one process or a torchrun group, and its run directory.

`open_participant` gives the loop what it needs whether it runs alone or as one rank of
a torchrun group: the object to call `step` on (a `Participant`, or a
`DistributedParticipant` whose rank 0 holds one) and the module to run forward and
backward through (the model, or its `DistributedDataParallel` wrapper).

`RunDir` is the participant's local directory: the checkpoint written at every round
boundary and restored at start (inner optimizer state, data position, counters), the
per-round metrics (JSON lines, TensorBoard when installed) and, at the end, the final
weights of the sync set. Under torchrun rank 0 owns `DIR/`; rank k keeps its own
checkpoint (its data position) in `DIR/rank-k/`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedtrain.participant import CoordinatorClient, Participant
from fedtrain.participant.checkpoint import LocalCheckpoint
from fedtrain.participant.distributed import DistributedParticipant
from fedtrain.participant.metrics_log import MetricsLog
from fedtrain.participant.runner import EvalFn, sync_set
from fedtrain.recipes.data import TokenStream
from fedtrain.wire import write_file

__all__ = ["RunDir", "open_participant", "round_line"]

log = logging.getLogger("fedtrain.recipe")

Fed = Participant | DistributedParticipant


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
    speed: float = 1.0,
) -> tuple[Fed, nn.Module]:
    """(the participant to step, the module to train through) for one process or a torchrun group.
    `key_file` keeps the participant key, so that a restarted process rejoins as itself at once;
    `speed` below 1 throttles its inner steps (a slow site on purpose: `participant/pace.py`)."""

    def make() -> Participant:
        return Participant(client, model=model, inner_optimizer=optimizer, eval_fn=eval_fn, name=name, info=info,
                           key_file=key_file, speed=speed)

    if world_size <= 1:
        return make(), model
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    net = DistributedDataParallel(model, device_ids=ids)
    return DistributedParticipant(model, make_participant=make, device=device), net


def _inner(fed: Fed) -> Participant | None:
    return fed.fed if isinstance(fed, DistributedParticipant) else fed


class RunDir:
    """A participant's local directory (see the module docstring); one per participant name."""

    def __init__(self, directory: str | Path, rank: int = 0) -> None:
        self.dir = Path(directory)
        self.rank = rank
        own = self.dir if rank == 0 else self.dir / f"rank-{rank}"
        self.checkpoint = LocalCheckpoint(own / "checkpoint")
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
        log.info(
            "resumed the local checkpoint of round %d (%d batches drawn, %d steps)",
            saved["round"],
            stream.position,
            saved["steps"],
        )
        return saved

    def restore_counters(self, fed: Fed, saved: dict[str, Any]) -> None:
        for obj in (fed, _inner(fed)):
            if obj is not None:
                obj.steps, obj.tokens = int(saved["steps"]), int(saved["tokens"])

    def after_sync(self, fed: Fed, optimizer: torch.optim.Optimizer, stream: TokenStream) -> None:
        """At a round boundary: write the checkpoint and the round's metrics."""
        self.checkpoint.save(
            round_=fed.round,
            optimizer=optimizer,
            steps=fed.steps,
            tokens=fed.tokens,
            user_state={"data": stream.state_dict()},
        )
        inner = _inner(fed)
        if self.metrics is not None and inner is not None and inner.history:
            self.metrics.write(inner.history[-1])

    def finish(self, model: nn.Module) -> Path:
        """Write this rank's final weights of the sync set; returns the file."""
        name = "final.safetensors" if self.rank == 0 else f"final-rank{self.rank}.safetensors"
        path = self.dir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        tensors = {n: p.detach().to("cpu") for n, p in sync_set(model).items()}
        write_file(path, tensors, {"written_by": "fedtrain participant"})
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
