"""`Participant`: joins a user's ordinary PyTorch loop to a federated run.

    with Participant(url, token=TOKEN, model=model, inner_optimizer=opt) as fed:
        while not fed.finished:
            loss = train_step(...)
            fed.step(tokens=n_tokens, loss=loss)

`step` counts inner steps and tokens; every H steps it syncs: upload Δ = θ_round − θ_local,
wait for the round to close, load the new global weights into the model. The inner
optimizer is never touched, so its state carries over. The trainable parameters are the
sync set. A snapshot of θ_round (one copy of the sync set, on the CPU) is the only extra
memory: at sync it becomes Δ in place, then receives the new global weights.

The round trip itself belongs to a `SyncEngine` (`sync.py`), which owns the snapshot; the
blocking sync runs it on the training thread, the overlapped sync (`overlap.py`) on a worker
thread while training goes on. Every call a sync attempt makes is bounded by the outage
policy's `attempt_s`, passed with the call (`retry=`), never set on the shared client.
Heartbeats and the coordinator's event stream run on two threads of their own (`presence.py`).
A participant acts only as itself, with the participant key of its join answer (`keys.py`).
Streaming DiLoCo (config `streaming`) syncs one fragment per round (`fragments.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedtrain import faults
from fedtrain.config import RunConfig
from fedtrain.errors import CoordinatorError, CoordinatorUnavailable
from fedtrain.participant.client import CoordinatorClient, RetryPolicy, Timeouts
from fedtrain.participant.fragments import FragmentSync, plan_of
from fedtrain.participant.keys import join_as
from fedtrain.participant.outage import OutagePolicy, OutageState, is_transient
from fedtrain.participant.overlap import OverlappedSync
from fedtrain.participant.pace import Pace, told_steps
from fedtrain.participant.presence import Presence, TokenRate
from fedtrain.participant.sync import SyncEngine

log = logging.getLogger("fedtrain.participant")

EvalFn = Callable[[nn.Module], "float | dict[str, float]"]
ConfigCallback = Callable[[RunConfig, RunConfig, dict[str, list[Any]]], None]


def sync_set(model: nn.Module) -> dict[str, nn.Parameter]:
    """The tensors that travel: the model's trainable parameters, by name."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


class Participant:
    """A context manager around a training loop that syncs it with a coordinator.

    A model sharded with FSDP2 (`fully_shard`, under torchrun) gives an `FsdpParticipant`
    instead, made from the same arguments: every rank constructs it, and each syncs its own
    shard (`fsdp.py`)."""

    def __new__(cls, coordinator: str | CoordinatorClient, *, model: nn.Module, **kwargs: Any) -> Participant:
        from fedtrain.participant.shards import is_sharded

        if cls is not Participant or not is_sharded(sync_set(model)):
            return super().__new__(cls)
        from fedtrain.participant.fsdp import fsdp_participant

        # Not a Participant, so Python does not call __init__ on it: it has the same loop surface.
        return fsdp_participant(coordinator, model, kwargs)  # type: ignore[return-value]

    def __init__(
        self,
        coordinator: str | CoordinatorClient,
        *,
        model: nn.Module,
        token: str | None = None,
        inner_optimizer: torch.optim.Optimizer | None = None,
        eval_fn: EvalFn | None = None,
        name: str | None = None,
        info: dict[str, Any] | None = None,
        timeouts: Timeouts = Timeouts(),
        retry: RetryPolicy = RetryPolicy(),
        verify: bool | str = True,
        outage: OutagePolicy = OutagePolicy(),
        key_file: str | Path | None = None,
        speed: float = 1.0,
    ) -> None:
        if isinstance(coordinator, CoordinatorClient):
            self.client = coordinator
        else:
            if token is None:
                raise ValueError("Participant needs token= when given a coordinator URL")
            self.client = CoordinatorClient(coordinator, token, timeouts=timeouts, retry=retry, verify=verify)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.outage_policy = outage
        self._outage = OutageState()
        self._outage_budget_s = outage.budget_s if outage.budget_s is not None else self.client.retry.max_elapsed_s
        self._attempt_retry = self.client.retry.within(outage.attempt_s)  # each call of one sync attempt
        self.outages: list[dict[str, Any]] = []  # each outage ridden out: {"round", "seconds", "attempts"}
        self.eval_fn = eval_fn
        self.name = name
        self.info = info or {}
        self.key_file = Path(key_file) if key_file is not None else None
        self.participant_id: str = ""
        self.config: RunConfig = RunConfig()
        self.round = 0
        self.finished = False
        self.steps = 0
        self.tokens = 0
        self.sync_seconds = 0.0
        self.history: list[dict[str, Any]] = []
        self._round_steps = 0
        self._round_tokens = 0
        self._round_losses: list[float] = []
        self._last_loss: float | None = None
        self._rate = TokenRate()
        self._pace = Pace(speed)  # the loop's own step rate; `speed` < 1 throttles it on purpose
        self._told: tuple[int, str] | None = None  # this round's H and why, as the coordinator told it
        self.config_version = 0
        self._callbacks: list[ConfigCallback] = []
        self._presence = Presence(self.client, interval_s=lambda: self.config.heartbeat_interval_s,
                                  stats=self._heartbeat_stats)
        self._engine = SyncEngine(self.client, sync_set(model), who=name, patience_s=self._outage_budget_s)
        self._overlap = OverlappedSync(self._engine)
        self._fragments: FragmentSync | None = None  # Streaming DiLoCo (`fragments.py`), from the join
        self._unsent_tokens = 0  # streaming: tokens since the last fragment's Δ was taken
        self._sent_at: tuple[int, int] | None = None  # streaming: the byte counts when the fragment in flight was sent
        self.changed: list[str] | None = None  # the tensors the last sync changed (a fragment's), None: all

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Participant:
        joined = join_as(self.client, self.name, self.info, self.key_file)
        self.participant_id = joined["participant_id"]
        self.config = RunConfig.model_validate(joined["config"])
        self.config_version = int(joined["config_version"])
        self._told = told_steps(joined)
        self._presence.note_config_version(self.config_version)
        self._engine.prepare(joined["model"])
        self.round = self._engine.load_global(self.participant_id)
        plan = plan_of(joined)
        if plan is not None:
            self._fragments = FragmentSync(self._engine, plan)
        self.finished = bool(joined["finished"])
        self._presence.start(self.participant_id)
        log.info("joined as %s at round %d (H=%d)", self.participant_id, self.round, self.sync_every)
        self._pace.resume()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None and self._overlap.pending:
                self._land()  # the last overlapped round lands before we leave
            if exc[0] is None and self._fragments is not None and self._fragments.pending is not None:
                self._stream_land()  # and so does the last fragment in flight
        finally:
            self._overlap.close()
            if self._fragments is not None:
                self._fragments.close()
            self._presence.stop()
            self._leave(crashed=isinstance(exc[1], faults.InjectedCrash))

    def _leave(self, crashed: bool) -> None:
        if not crashed:  # a crashed process says no goodbye
            try:
                self.client.leave(self.participant_id, retry=RetryPolicy(max_elapsed_s=2.0))
            except CoordinatorError as e:
                log.info("could not say goodbye to the coordinator: %s", e.message)
        self.client.close()

    @property
    def bytes_up(self) -> int:
        """Bytes of updates this participant has uploaded."""
        return self._engine.bytes_up + (self._fragments.bytes_up if self._fragments is not None else 0)

    @property
    def bytes_down(self) -> int:
        """Bytes of global models this participant has downloaded."""
        return self._engine.bytes_down + (self._fragments.bytes_down if self._fragments is not None else 0)

    @property
    def latest_config_version(self) -> int:
        """The newest config version announced by the coordinator (in force from a later round)."""
        return self._presence.latest_config_version

    @property
    def events(self) -> list[tuple[str, Any]]:
        """Recent config changes and run events of the coordinator's stream: (kind, data)."""
        return self._presence.events

    @property
    def sync_in_flight(self) -> bool:
        """Whether an overlapped sync (or a streaming fragment's) has been sent and has not landed yet."""
        return self._overlap.pending or (self._fragments is not None and self._fragments.pending is not None)

    def wait_sync_in_flight(self, timeout_s: float | None = None) -> bool:
        """Block until an overlapped sync in flight has its answer (it lands at the next `step`),
        or `timeout_s` has passed; True when nothing is left running."""
        return self._overlap.wait(timeout_s)

    @property
    def sync_every(self) -> int:
        """The inner steps of this round: H as the coordinator told it (balanced rounds give each
        participant its own), else train.sync_every; streaming, H/K (a round syncs one fragment)."""
        h = self._told[0] if self._told is not None else self.config.train.sync_every
        return h // self._fragments.k if self._fragments is not None else h

    def on_config_change(self, callback: ConfigCallback) -> ConfigCallback:
        """Call `callback(old, new, diff)` at the round boundary where a new config takes effect
        (diff: dotted field -> [old, new]); for fields the user's own loop owns. Returns it,
        so it can decorate a function."""
        self._callbacks.append(callback)
        return callback

    # -- the user's loop -------------------------------------------------------------------

    def step(self, tokens: int, loss: float | None = None) -> bool:
        """Count one inner step; sync when H steps have passed. Returns True if it synced."""
        if self.finished:
            return False
        self._pace.stepped()  # the loop's step is timed (and throttled) without the sync
        try:
            return self._step(tokens, loss)
        finally:
            self._pace.resume()

    def _step(self, tokens: int, loss: float | None) -> bool:
        self.steps += 1
        self.tokens += tokens
        self._round_steps += 1
        self._round_tokens += tokens
        self._rate.add(tokens)
        if loss is not None:
            self._last_loss = float(loss)
            self._round_losses.append(float(loss))
        if self._fragments is not None:
            self._unsent_tokens += tokens
            return self._stream_step()
        if self._overlap.ready:
            self._land()
            if self.finished:
                return True
        if self._round_steps >= self.sync_every and time.monotonic() >= self._outage.next_at:
            if self.config.train.overlap:
                self._send_overlapped()
                return True
            if self._overlap.pending:  # overlap was switched off: land the pending round first
                self._land()
                if self.finished:
                    return True
            return self.sync()
        return False

    def sync(self) -> bool:
        """Upload this round's Δ, wait for the round to close, load the new global model.

        Returns False when the coordinator could not be reached: training goes on and the
        sync is tried again after a backoff (see `participant/outage.py`)."""
        t0 = time.perf_counter()
        r = self.round
        faults.hit("participant.sync", who=self.name or self.participant_id, round=r)
        if self._outage.active and not self._coordinator_back():
            return False
        record = self._open_record(r)
        if not self._attempt_sync(r):
            return False
        self._close_record(record, r, time.perf_counter() - t0)
        return True

    def _open_record(self, r: int) -> dict[str, Any]:
        """The round's record so far: counts, mean train loss, eval before the sync."""
        record: dict[str, Any] = {"round": r, "steps": self._round_steps, "tokens": self._round_tokens,
                                  "config_version": self.config_version, "sync_every": self.sync_every,
                                  "_up0": self.bytes_up, "_down0": self.bytes_down}
        if self._round_losses:
            record["train_loss"] = sum(self._round_losses) / len(self._round_losses)
        record.update(self._evaluate("eval_before") if self.eval_due(r) else {})
        return record

    def _reset_round(self) -> None:
        self._round_steps, self._round_tokens, self._round_losses = 0, 0, []

    def _close_record(self, record: dict[str, Any], r: int, blocked_s: float, reset: bool = True) -> None:
        """After the new global weights are in: eval after, report, take the new config."""
        record.update(self._evaluate("eval_after") if self.eval_due(r) else {})
        record["bytes_up"] = self.bytes_up - record.pop("_up0")
        record["bytes_down"] = self.bytes_down - record.pop("_down0")
        self.sync_seconds += blocked_s
        record["sync_s"] = blocked_s
        self.history.append(record)
        values = {k: float(v) for k, v in record.items()
                  if k not in ("round", "steps", "config_version", "sync_every")}
        try:
            self.client.report(self.participant_id, values, round_=r, step=self.steps, retry=self._attempt_retry)
        except CoordinatorError as e:
            log.warning("could not report metrics of round %d: %s", r, e.message)
        if reset:  # (an overlapped sync reset the counts when it sent the update)
            self._reset_round()
        try:
            self._apply_config()
        except CoordinatorError as e:
            if not is_transient(e):
                raise
            log.warning("could not fetch the config of round %d (%s); keeping the current one", self.round, e.message)

    # -- the overlapped sync ----------------------------------------------------------------------

    def _send_overlapped(self) -> None:
        """At the H-th step: send this round's Δ in the background and return at once."""
        t0 = time.perf_counter()
        if self._overlap.pending:  # the previous exchange is late: wait for it
            self._land()
            if self.finished:
                return
        r = self.round
        record = self._open_record(r)
        self._overlap.start(r, self.participant_id, self.config, tokens=max(1, self._round_tokens), record=record)
        self._reset_round()
        self.sync_seconds += time.perf_counter() - t0

    def _land(self) -> None:
        """Apply the overlapped exchange's result (waiting for it if needed)."""
        t0 = time.perf_counter()
        landed = self._overlap.finish()
        if landed is None:  # it failed: the local progress is kept, the round's contribution lost
            return
        self._enter_round(landed.version)
        self._engine.adopt(None if self.finished else landed.sent)  # the run is over: end on the global model
        self._close_record(landed.record, landed.round, time.perf_counter() - t0, reset=False)

    def _enter_round(self, version: int) -> None:
        """The model now holds global version `version`: it is the round we are in."""
        self.round = version
        self.finished = self.config.rounds > 0 and version >= self.config.rounds

    # -- Streaming DiLoCo (`fragments.py`) ---------------------------------------------------------

    def _stream_step(self) -> bool:
        """After a step of a streaming run: send this round's fragment τ steps before the round's
        end, land it at the end (in the overlapped mode: at the first step after it is there)."""
        fs = self._fragments
        assert fs is not None
        s = self.sync_every
        if fs.pending is not None:
            if self._round_steps < s or (self.config.train.overlap and not fs.ready):
                return False
            return self._stream_land()
        if self._round_steps >= s:  # τ = 0, or a send that failed: the whole exchange now
            return time.monotonic() >= self._outage.next_at and self._stream_land()
        tau = self.config.streaming.overlap if self.config.streaming is not None else 0
        if tau > 0 and self._round_steps >= s - tau and time.monotonic() >= self._outage.next_at:
            r = self.round
            faults.hit("participant.sync", who=self.name or self.participant_id, round=r)
            self._sent_at = (self.bytes_up, self.bytes_down)
            fs.send(r, self.participant_id, self.config, tokens=max(1, self._unsent_tokens),
                    retry=self._attempt_retry)
            self._unsent_tokens = 0
        return False

    def _stream_land(self) -> bool:
        """Land the fragment in flight (waiting for it), or, with none in flight (τ = 0, or an
        attempt after a failure), run round r's fragment exchange on the training thread."""
        fs = self._fragments
        assert fs is not None
        t0, r = time.perf_counter(), self.round
        try:
            if fs.pending is not None:
                r, version = fs.pending.round, fs.wait()[1]
            else:
                faults.hit("participant.sync", who=self.name or self.participant_id, round=r)
                if self._outage.active and not self._coordinator_back():
                    return False
                self._sent_at = (self.bytes_up, self.bytes_down)
                version = fs.fetch(r, self.participant_id, self.config, tokens=max(1, self._unsent_tokens),
                                   retry=self._attempt_retry)
                self._unsent_tokens = 0
        except CoordinatorError as e:
            if not is_transient(e):
                raise
            self._outage_failed(r, e)  # the round's exchange is tried again, whole, after a backoff
            return False
        return self._stream_landed(r, fs.of(r), version, time.perf_counter() - t0)

    def _stream_landed(self, r: int, fragment: int, version: int, blocked_s: float) -> bool:
        """Round r's result (`version`) is in fragment `fragment`'s snapshot: evaluate before, mix,
        evaluate after, report. Past r + 1 (rounds went on without us), or the end: the whole global model."""
        fs = self._fragments
        assert fs is not None
        record = {**self._open_record(r), "fragment": fragment}
        record["_up0"], record["_down0"] = self._sent_at or (record["_up0"], record["_down0"])  # bytes since the send
        self._sent_at = None
        self.changed = fs.mix(fragment, self.config.streaming.alpha if self.config.streaming is not None else 0.0)
        if version not in (r, r + 1):
            log.warning("round %d ended at version %d: rounds went on without us; taking the global model", r, version)
            version, self.changed = self._engine.load_global(self.participant_id, retry=self._attempt_retry), None
        elif self.config.rounds > 0 and version >= self.config.rounds:  # the end: every fragment the global one
            self.changed = fs.take_global(self.participant_id, version, fragment, retry=self._attempt_retry)
        self._enter_round(version)
        self._outage_over(r)
        self._close_record(record, r, blocked_s)
        return True

    # -- riding out an outage ----------------------------------------------------------------------

    def _attempt_sync(self, r: int) -> bool:
        """One sync attempt; on a transient failure (the engine has put the snapshot back) schedule
        the next attempt and return False (or raise CoordinatorUnavailable once the outage budget
        is spent)."""
        try:
            version = self._engine.sync(r, self.participant_id, self.config, tokens=max(1, self._round_tokens),
                                        retry=self._attempt_retry)
        except CoordinatorError as e:
            if not is_transient(e):
                raise
            self._outage_failed(r, e)
            return False
        self._enter_round(version)
        self._outage_over(r)
        return True

    def _outage_over(self, r: int) -> None:
        """Round r synced: an outage being ridden out is over (and recorded)."""
        ended, self._outage = self._outage.ended(r), OutageState()
        if ended is not None:
            self.outages.append(ended)

    def _coordinator_back(self) -> bool:
        """During an outage: a cheap probe before spending an eval and an upload on an attempt."""
        try:
            self.client.health(retry=self.client.retry.within(min(2.0, self.outage_policy.attempt_s)))
        except CoordinatorError as e:
            self._outage_failed(self.round, e)
            return False
        return True

    def _outage_failed(self, r: int, error: CoordinatorError) -> None:
        decision = self._outage.fail(error.message, self.outage_policy, self._outage_budget_s)
        if decision.action == "give_up":
            raise CoordinatorUnavailable(decision.reason, status=0, code="unavailable")
        log.warning("round %d: %s", r, decision.reason)

    def _apply_config(self) -> None:
        """At a round boundary: take the config in force for the round we now start."""
        if self.finished:
            return
        if self.config.schedule.mode == "balanced":  # the step rate our next H is set from, fresh
            self._beat(**self._heartbeat_stats())
        view = self.client.get_config(round_=self.round, participant_id=self.participant_id,
                                      retry=self._attempt_retry)
        told, self._told = self._told, told_steps(view)
        if self._told is not None and self._told != told:
            log.info("round %d: H=%d (%s)", self.round, *self._told)
        if int(view["version"]) == self.config_version:
            return
        old, new = self.config, RunConfig.model_validate(view["config"])
        from fedtrain.config.changes import config_diff

        diff = config_diff(old.model_dump(mode="json"), new.model_dump(mode="json"))
        self.config, self.config_version = new, int(view["version"])
        self._presence.note_config_version(self.config_version)
        if "train.lr" in diff and self.inner_optimizer is not None:
            for group in self.inner_optimizer.param_groups:
                group["lr"] = new.train.lr
        log.info("config v%d in force from round %d: %s", self.config_version, self.round,
                 ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items()))
        for callback in self._callbacks:
            callback(old, new, diff)
        self._beat(step=self.steps, round=self.round, config_version=self.config_version)  # the version we run

    def _beat(self, **stats: Any) -> None:
        """One heartbeat now, from the training thread (a failure is left to the next beat)."""
        try:
            self.client.heartbeat(self.participant_id, retry=self._attempt_retry, **stats)
        except CoordinatorError as e:
            log.debug("heartbeat failed: %s", e.message)

    # -- evaluation ----------------------------------------------------------------------------

    def eval_due(self, r: int) -> bool:
        """Whether round `r` is evaluated around its sync: every `eval.every` rounds, and the last."""
        last = self.config.rounds > 0 and r + 1 >= self.config.rounds
        return r % self.config.eval.every == 0 or last

    def _evaluate(self, prefix: str) -> dict[str, float]:
        if self.eval_fn is None:
            return {}
        result = self.eval_fn(self.model)
        if isinstance(result, dict):
            return {f"{prefix}/{k}": float(v) for k, v in result.items()}
        return {f"{prefix}/loss": float(result)}

    def _heartbeat_stats(self) -> dict[str, Any]:
        """What each heartbeat tells (read on the heartbeat thread)."""
        return {"step": self.steps, "round": self.round, "loss": self._last_loss,
                "tokens_per_s": self._rate.per_second(), "steps_per_s": self._pace.steps_per_s,
                "config_version": self.config_version}
