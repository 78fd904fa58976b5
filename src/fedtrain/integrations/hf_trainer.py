"""`FedtrainCallback`: a Hugging Face `Trainer` that takes part in a fedtrain run.

An existing Trainer script federates by adding the callback:

    from fedtrain.integrations.hf_trainer import FedtrainCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[FedtrainCallback("http://coord:8000", token=TOKEN, name="site-a")])
    trainer.train()

At `on_train_begin` the callback joins the run with the Trainer's model and optimizer
(the model's trainable parameters are the sync set; the global weights replace the
model's at once). After every optimizer step (`on_step_end`) it counts the step and its
tokens, and every H steps it syncs: eval before, upload Δ, wait, load the new global
weights, eval after. When the run is finished it stops the Trainer. Under torchrun (the
Trainer's DDP) every rank holds the `Participant`: rank 0 talks to the coordinator and the others
take the new weights through `torch.distributed` (see `fedtrain.participant.ranks.roles`).

Tokens per step come from `state.num_input_tokens_seen` when the Trainer counts them
(`include_num_input_tokens_seen`), else from `tokens_per_step`, else each step counts as
one token (contributions are then weighted by steps).

With `run_dir`, rank 0 keeps its participant key there (`participant-key.json`, mode
600): a Trainer restarted with the same directory rejoins the run as itself at once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from fedtrain.participant import CoordinatorClient, Participant, RetryPolicy
from fedtrain.participant.engine.records import EvalFn
from fedtrain.participant.local.metrics_log import MetricsLog

__all__ = ["FedtrainCallback"]

log = logging.getLogger("fedtrain.participant")

KEY_FILE = "participant-key.json"


class FedtrainCallback(TrainerCallback):
    """Joins a Trainer's loop to the fedtrain run at `coordinator` (see the module docstring)."""

    def __init__(
        self,
        coordinator: str | CoordinatorClient,
        *,
        token: str | None = None,
        name: str | None = None,
        eval_fn: EvalFn | None = None,
        tokens_per_step: int | None = None,
        run_dir: str | Path | None = None,
        info: dict[str, Any] | None = None,
        verify: bool | str = True,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        if isinstance(coordinator, CoordinatorClient):
            self.client = coordinator
        else:
            if token is None:
                raise ValueError("FedtrainCallback needs token= when given a coordinator URL")
            self.client = CoordinatorClient(coordinator, token, verify=verify, retry=retry)
        self.name = name
        self.eval_fn = eval_fn
        self.tokens_per_step = tokens_per_step
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.info = {"integration": "transformers.Trainer", **(info or {})}
        self.fed: Participant | None = None
        self.metrics: MetricsLog | None = None
        self._loss: float | None = None
        self._seen = 0
        self._world = 1

    @property
    def participant(self) -> Participant | None:
        """The `Participant` (history, bytes, round; the same on every rank); None before training."""
        return self.fed

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model, optimizer = kwargs["model"], kwargs.get("optimizer")

        self._world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.fed = Participant(
            self.client,
            model=model,
            inner_optimizer=optimizer,
            eval_fn=self.eval_fn,
            name=self.name,
            info=self.info,
            key_file=self.run_dir / KEY_FILE if self.run_dir is not None else None,  # rejoin as itself
        )
        self.fed.__enter__()
        self._seen = state.num_input_tokens_seen
        if self.run_dir is not None and state.is_world_process_zero:
            self.metrics = MetricsLog(self.run_dir)
        if self.fed.finished:
            control.should_training_stop = True

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs and "loss" in logs:
            self._loss = float(logs["loss"])

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        fed = self.fed
        if fed is None or fed.finished:
            control.should_training_stop = True
            return
        if fed.step(tokens=self._step_tokens(state), loss=self._loss):
            inner = self.participant
            if self.metrics is not None and inner is not None and inner.history:
                self.metrics.write(inner.history[-1])
        if fed.finished:
            control.should_training_stop = True

    def _step_tokens(self, state: TrainerState) -> int:
        seen = state.num_input_tokens_seen
        delta, self._seen = seen - self._seen, seen
        if delta > 0:
            return max(1, delta // self._world)  # the Trainer's count is summed over ranks already
        return self.tokens_per_step or 1

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.fed is not None:
            self.fed.__exit__(None, None, None)
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
