"""The book of a participant's rounds: the config in force, the counts of the round, and one record
per round synced (counts, train loss, evals before and after, bytes, sync time over every attempt
of the round, failed ones included, and their number), reported to the
coordinator at each round boundary, where the config of the next round is taken (on every rank).

`RoundBook` owns those fields; the participant (`runner.py`) opens a round's record before its
exchange and closes it after the result landed. See docs/architecture.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fedtrain.config import RunConfig
from fedtrain.config.changes import config_diff
from fedtrain.errors import CoordinatorError
from fedtrain.participant.client.coordinator_client import CoordinatorClient
from fedtrain.participant.client.presence import Presence
from fedtrain.participant.client.retry import RetryPolicy
from fedtrain.participant.engine.outage import is_transient
from fedtrain.participant.engine.pace import told_steps
from fedtrain.participant.ranks.control import DistributedSyncError, RankGroup

__all__ = ["ConfigCallback", "EvalFn", "RoundBook"]

log = logging.getLogger("fedtrain.participant")

EvalFn = Callable[[nn.Module], "float | dict[str, float]"]
ConfigCallback = Callable[[RunConfig, RunConfig, dict[str, list[Any]]], None]

_NOT_REPORTED = ("round", "steps", "config_version", "sync_every", "piece", "fragment")


class RoundBook:
    """The config in force and the record of every round, of one rank (the same on every rank)."""

    def __init__(self, ranks: RankGroup, client: CoordinatorClient, model: nn.Module, *, eval_fn: EvalFn | None,
                 everywhere: bool, inner_optimizer: torch.optim.Optimizer | None, presence: Presence | None,
                 retry: RetryPolicy, stats: Callable[[], dict[str, Any]],
                 settle: Callable[[], None] = lambda: None) -> None:
        self.ranks = ranks
        self.client = client
        self.model = model
        self.eval_fn = eval_fn
        self.everywhere = everywhere  # eval_fn runs on every rank (FSDP), else on rank 0
        self.inner_optimizer = inner_optimizer
        self.presence = presence
        self.retry = retry
        self.stats = stats
        self.config = RunConfig()
        self.config_version = 0
        self.told: tuple[int, str] | None = None  # this round's H and why, as the coordinator told it
        self.history: list[dict[str, Any]] = []
        self.sync_seconds = 0.0
        self.bytes_up = 0  # the group's, all ranks together
        self.bytes_down = 0
        self.round_steps = 0
        self.round_tokens = 0
        self._loss = [0.0, 0.0]  # the round's loss sum and count (the group's)
        self._first_tokens: tuple[int, int] | None = None  # (round, tokens) of a round's first attempt
        self._failed: dict[int, tuple[int, float]] = {}  # round -> its failed sync attempts: count, seconds
        self._callbacks: list[ConfigCallback] = []
        self.settle = settle  # after an eval: the model as the sync needs it (FSDP: resharded)

    def joined(self, answer: dict[str, Any]) -> None:
        self.config = RunConfig.model_validate(answer["config"])
        self.config_version = int(answer["config_version"])
        self.told = told_steps(answer)

    def on_config_change(self, callback: ConfigCallback) -> ConfigCallback:
        self._callbacks.append(callback)
        return callback

    # -- the round's counts ---------------------------------------------------------------------------

    def counted(self, tokens: int, loss_sum: float, losses: float) -> None:
        self.round_tokens += tokens
        self._loss = [self._loss[0] + loss_sum, self._loss[1] + losses]

    def reset_counts(self) -> None:
        self.round_steps, self.round_tokens, self._loss = 0, 0, [0.0, 0.0]

    def tokens_of(self, r: int, unsent: int, *, fixed: bool) -> int:
        """The token count an attempt at round r sends: the tokens not yet sent; with `fixed` (an
        update in pieces) the first attempt's, since a piece of it may be in already and the
        pieces of one update carry one count."""
        if fixed and self._first_tokens is not None and self._first_tokens[0] == r:
            return self._first_tokens[1]
        self._first_tokens = (r, max(1, unsent))
        return self._first_tokens[1]

    def attempt_failed(self, r: int, seconds: float) -> None:
        """A sync attempt of round r failed after `seconds` (it is tried again later): its time
        counts in the round's `sync_s` once the round syncs, and in `sync_seconds` now."""
        n, s = self._failed.get(r, (0, 0.0))
        self._failed = {k: v for k, v in self._failed.items() if k >= r}  # rounds given up on: forgotten
        self._failed[r] = (n + 1, s + seconds)
        self.sync_seconds += seconds

    # -- one round's record ------------------------------------------------------------------------------

    def eval_due(self, r: int) -> bool:
        """Whether round `r` is evaluated around its sync: every `eval.every` rounds, and the last."""
        last = self.config.rounds > 0 and r + 1 >= self.config.rounds
        return self.eval_fn is not None and (r % self.config.eval.every == 0 or last)

    def open(self, r: int, sync_every: int) -> dict[str, Any]:
        """Round r's record before its exchange: the eval before the sync."""
        record: dict[str, Any] = {"round": r, "config_version": self.config_version, "sync_every": sync_every}
        if self.eval_due(r):
            record.update(self.evaluate("eval_before"))
        return record

    def stamp(self, record: dict[str, Any]) -> None:
        """The round's counts into its record (once: at the send of an overlapped sync, else at its close)."""
        record.setdefault("steps", self.round_steps)
        record.setdefault("tokens", self.round_tokens)
        if self._loss[1] > 0:
            record.setdefault("train_loss", self._loss[0] / self._loss[1])

    def close(self, record: dict[str, Any], r: int, blocked_s: float, moved: tuple[int, int], *, pid: str,
              steps: int, now_in: int, finished: bool, reset: bool = True) -> None:
        """After the new global weights are in: eval after, the group's bytes, report, the config of
        the round we are now in (`now_in`). `reset`: the round's counts start again (an overlapped
        sync reset them when it sent)."""
        if self.eval_due(r):
            record.update(self.evaluate("eval_after"))
        up, down = self.ranks.sum(moved)
        self.bytes_up += int(up)
        self.bytes_down += int(down)
        self.stamp(record)
        failed, failed_s = self._failed.pop(r, (0, 0.0))
        # every attempt of the round: the failed ones (a link down, a silent connection) too
        record.update(bytes_up=int(up), bytes_down=int(down), sync_s=blocked_s + failed_s, sync_attempts=failed + 1)
        self.sync_seconds += blocked_s
        self.history.append(record)
        if reset:
            self.reset_counts()
        outcomes, error = self.ranks.together(
            (lambda: self._report_and_config(record, pid, steps, now_in, finished)) if self.ranks.lead else None)
        if error is not None:
            raise error
        if not outcomes[0].ok:
            raise DistributedSyncError(f"rank 0 of this participant failed: {outcomes[0].error}")
        view = outcomes[0].result
        if view is not None:
            told, self.told = self.told, told_steps(view)
            if self.told is not None and self.told != told and self.ranks.lead:
                log.info("round %d: H=%d (%s)", now_in, *self.told)
            if int(view["version"]) != self.config_version:
                self._apply_config(view, now_in, steps, pid)

    def _report_and_config(self, record: dict[str, Any], pid: str, steps: int, now_in: int,
                           finished: bool) -> dict[str, Any] | None:
        """Rank 0: report the round's metrics; the config view of the round we are now in (None:
        the run is over, or unreachable for now, which keeps the current one)."""
        values = {k: float(v) for k, v in record.items() if k not in _NOT_REPORTED}
        try:
            self.client.report(pid, values, round_=record["round"], step=steps, retry=self.retry)
        except CoordinatorError as e:
            log.warning("could not report metrics of round %d: %s", record["round"], e.message)
        if finished:
            return None
        try:
            if self.config.schedule.mode == "balanced":  # the step rate our next H is set from, fresh
                self.beat(pid, **self.stats())
            view = self.client.get_config(round_=now_in, participant_id=pid, retry=self.retry)
        except CoordinatorError as e:
            if not is_transient(e):
                raise
            log.warning("could not fetch the config of round %d (%s); keeping the current one", now_in, e.message)
            return None
        return dict(view)

    def _apply_config(self, view: dict[str, Any], now_in: int, steps: int, pid: str) -> None:
        """On every rank: the config in force for the round we now start."""
        old, new = self.config, RunConfig.model_validate(view["config"])
        diff = config_diff(old.model_dump(mode="json"), new.model_dump(mode="json"))
        self.config, self.config_version = new, int(view["version"])
        if "train.lr" in diff and self.inner_optimizer is not None:
            for group in self.inner_optimizer.param_groups:
                group["lr"] = new.train.lr
        for callback in self._callbacks:
            callback(old, new, diff)
        if self.presence is not None:
            self.presence.note_config_version(self.config_version)
            log.info("config v%d in force from round %d: %s", self.config_version, now_in,
                     ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items()))
            self.beat(pid, step=steps, round=now_in, config_version=self.config_version)  # the version we run

    def beat(self, pid: str, **stats: Any) -> None:
        """One heartbeat now (rank 0; a failure is left to the next beat)."""
        try:
            self.client.heartbeat(pid, retry=self.retry, **stats)
        except CoordinatorError as e:
            log.debug("heartbeat failed: %s", e.message)

    def evaluate(self, prefix: str) -> dict[str, float]:
        """`eval_fn` of the model: on every rank, averaged over the ranks (FSDP), or on rank 0 and
        told to the others."""
        assert self.eval_fn is not None
        eval_fn = self.eval_fn
        if self.everywhere:
            values = _values(eval_fn(self.model))
            self.settle()
            keys = self.ranks.broadcast_json(sorted(values))
            if sorted(values) != keys:
                raise DistributedSyncError(f"rank {self.ranks.rank}'s eval_fn returned {sorted(values)}, rank 0's "
                                           f"{keys}")
            means = self.ranks.sum([values[k] for k in keys])
            return {f"{prefix}/{k}": v / self.ranks.world_size for k, v in zip(keys, means, strict=True)}
        if self.ranks.solo:
            values = _values(eval_fn(self.model))
        else:
            outcomes, error = self.ranks.together((lambda: _values(eval_fn(self.model))) if self.ranks.lead else None)
            if error is not None:
                raise error
            if not outcomes[0].ok:
                raise DistributedSyncError(f"rank 0 of this participant failed: {outcomes[0].error}")
            values = outcomes[0].result
        return {f"{prefix}/{k}": float(v) for k, v in values.items()}


def _values(result: float | dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in result.items()} if isinstance(result, dict) else {"loss": float(result)}
