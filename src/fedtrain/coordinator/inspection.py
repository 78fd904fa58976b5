"""What a run holds inside, for a debugger, an embedding program and tests (`Coordinator.inspect`),
and what its model is (`model_view`, in the config a participant reads).

More: docs/architecture.md, "coordinator/inspection.py".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedtrain.coordinator.intake.flow import Intake
from fedtrain.coordinator.members.roster import Live, Roster
from fedtrain.coordinator.model.checkpoints import CheckpointDir
from fedtrain.coordinator.model.committer import Committer
from fedtrain.coordinator.rounds.progress import Rounds
from fedtrain.coordinator.state.store import ParticipantRow, Store
from fedtrain.wire import DTYPE_TO_ST


@dataclass(frozen=True)
class Inspection:
    """A look inside a run (`Coordinator.inspect`), documented field by field."""

    weights: Mapping[str, torch.Tensor]  # the global model's master weights (the open round's base)
    outer_state: Mapping[str, torch.Tensor]  # the outer optimizer's state tensors (e.g. momentum)
    outer_steps: int  # outer steps the optimizer took since it was made (a change of algorithm resets it)
    committed_version: int  # the newest version whose checkpoint is durable
    submitted: dict[str, int]  # the open round's updates, by participant: the tokens each counts
    late: dict[str, int]  # late updates folded into the open round, by `pid@lateR`: their tokens
    sum_count: int  # updates in the open round's running sum
    sum_weight: float  # their total weight
    sum_empty: bool  # no contribution is in the sum, counted or still being received into it
    sum_values: Mapping[str, torch.Tensor]  # the sum's accumulators as they are (stale while it is empty)
    participants: Mapping[str, ParticipantRow]  # the roster's rows, by participant id
    live: Mapping[str, Live]  # what each participant last reported (memory only)
    checkpoints: CheckpointDir  # the state directory's checkpoint files


def inspect_run(committer: Committer, rounds: Rounds, intake: Intake, roster: Roster) -> Inspection:
    """The parts' live state as an `Inspection` (the tensors and rows themselves, not copies)."""
    acc = intake.sum
    return Inspection(
        weights=committer.model.params,
        outer_state=committer.model.state_tensors(),
        outer_steps=committer.model.steps,
        committed_version=committer.committed_version,
        submitted=dict(rounds.open.submitted),
        late=dict(rounds.open.late),
        sum_count=acc.count,
        sum_weight=acc.total_weight,
        sum_empty=acc.is_empty,
        sum_values=acc.peek(),
        participants=roster.rows,
        live=roster.live,
        checkpoints=committer.ckpt,
    )


def model_view(store: Store, spec: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, Any]:
    """What the run's model is: `source` "recipe" (the config's `model` section builds it) or
    "custom" (version 0 came from --init-weights: a model of the user's own, which the `model`
    section does not describe), with its sync set's tensor count, parameters and dtypes."""
    custom = store.get_meta("model_source") == "init_weights"
    return {
        "source": "custom" if custom else "recipe",
        "init_weights": store.get_meta("init_weights") if custom else None,
        "tensors": len(spec),
        "parameters": sum(math.prod(s) for _, s in spec.values()),
        "dtypes": sorted({DTYPE_TO_ST[d] for d, _ in spec.values()}),
    }
