"""`Participant`: joins a user's ordinary PyTorch loop to a federated run, for every way a site
trains: one process, a DDP group, an FSDP group (the ranks strategy, `roles.py`), with every
schedule: blocking, overlapped, Streaming DiLoCo with any K, τ and α (`sync_schedule.py`).

    with Participant(url, token=TOKEN, model=model, inner_optimizer=opt) as fed:
        while not fed.finished:
            loss = train_step(...)
            fed.step(tokens=n_tokens, loss=loss)

Under torchrun every rank constructs it with the same arguments and steps it at the same steps.
Every collective is entered by every rank in the same order, on the group's own gloo control
group (`group.py`), and every decision is drawn from facts every rank holds. The round trip
itself belongs to each rank's `SyncEngine` (`sync.py`); riding out an outage to `outage.py`; the
round's record, report and config to `records.py`. See docs/architecture.md.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedtrain import faults
from fedtrain.config import RunConfig
from fedtrain.config.privacy import secagg_on
from fedtrain.errors import CoordinatorError, FedtrainError, ModelMismatchError
from fedtrain.participant.client.coordinator_client import CoordinatorClient, RetryPolicy, Timeouts
from fedtrain.participant.client.keys import join_as
from fedtrain.participant.client.presence import Presence, TokenRate
from fedtrain.participant.engine.outage import OutagePolicy
from fedtrain.participant.engine.pace import Pace, check_speed
from fedtrain.participant.engine.records import ConfigCallback, EvalFn, RoundBook
from fedtrain.participant.engine.ride_out import GroupOutage
from fedtrain.participant.engine.secagg_pieces import exchange_masked_pieces
from fedtrain.participant.engine.secagg_sync import start_ahead
from fedtrain.participant.engine.sync_schedule import Exchanges, InFlight, Plan, decide, plan_of
from fedtrain.participant.ranks.control import Outcome, RankGroup
from fedtrain.participant.ranks.roles import role_for

__all__ = ["Participant"]

log = logging.getLogger("fedtrain.participant")


class Participant:
    """A context manager around a training loop that syncs it with a coordinator.

    `coordinator`: its URL (with `token`) or a `CoordinatorClient`. `model` is the plain module
    (not a DDP wrapper; a `fully_shard`ed module for FSDP): its trainable parameters are the sync
    set. `eval_fn(model)` evaluates it before and after syncs (FSDP: on every rank, averaged).
    `group`: the torch.distributed group of the participant's ranks (None: every rank, when
    torch.distributed is initialised). `key_file` keeps the participant key, so that a restarted
    process rejoins as itself. `speed` below 1 throttles the loop (a slow site on purpose)."""

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
        group: Any = None,
        keepalive_s: float = 5.0,
    ) -> None:
        if isinstance(coordinator, CoordinatorClient):
            self.client = coordinator
        else:
            if token is None:
                raise ValueError("Participant needs token= when given a coordinator URL")
            self.client = CoordinatorClient(coordinator, token, timeouts=timeouts, retry=retry, verify=verify)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.ranks = RankGroup(group, keepalive_s)
        self._worker_ranks = self.ranks.for_worker()  # the overlapped sync's collectives (FSDP masked pieces)
        self.rank, self.world_size = self.ranks.rank, self.ranks.world_size
        self.role = role_for(model, self.ranks)
        self.name = name
        self.info = {**(info or {}), **self.role.info}
        self.key_file = Path(key_file) if key_file is not None and self.ranks.lead else None
        self.outage_policy = outage
        budget = outage.budget_s if outage.budget_s is not None else self.client.retry.max_elapsed_s
        self._outage = GroupOutage(self.ranks, self.client, outage, budget)  # (`ride_out.py`)
        self._attempt_retry = self.client.retry.within(outage.attempt_window(budget))  # each call of one attempt
        self.participant_id: str = ""
        self.round = 0
        self.finished = False
        self.steps = 0
        self.tokens = 0
        self._pending = [0.0, 0.0, 0.0]  # this rank's tokens, loss sum, loss count not yet summed
        self._unsent_tokens = 0  # the group's tokens since the last Δ was taken
        self._last_loss: float | None = None
        self._rate = TokenRate()
        # The loop's own step rate; `speed` < 1 throttles it on purpose. In a group only rank 0
        # sleeps: the other ranks wait for it in the step's collectives, so the group runs at its
        # pace. If every rank slept for its own step's time, each would also count the time it
        # waited for the others' sleep, and the pauses would grow without end (x1/speed a step).
        self._pace = Pace(check_speed(speed) if self.ranks.lead else 1.0)
        self._engine = self.role.engine(self.client, who=name or "participant", patience_s=budget,
                                        keepalive_s=keepalive_s)
        self._exchanges = Exchanges(None, None)  # made again from the join answer (its plan)
        self._presence = Presence(self.client, interval_s=lambda: self.config.heartbeat_interval_s,
                                  stats=self._heartbeat_stats) if self.ranks.lead else None
        self.book = RoundBook(self.ranks, self.client, model, eval_fn=eval_fn,
                              everywhere=self.role.evaluates_everywhere, inner_optimizer=inner_optimizer,
                              presence=self._presence, retry=self._attempt_retry, stats=self._heartbeat_stats,
                              settle=self.role.settle)
        self.changed: list[str] | None = None  # the tensors the last landing changed (a fragment's), None: all
        self._record: dict[str, Any] | None = None  # the blocking round's record, kept over its attempts

    # -- what the loop reads ---------------------------------------------------------------------

    @property
    def config(self) -> RunConfig:
        """The run config in force for the round we are in."""
        return self.book.config

    @property
    def config_version(self) -> int:
        return self.book.config_version

    @property
    def eval_fn(self) -> EvalFn | None:
        return self.book.eval_fn

    @property
    def history(self) -> list[dict[str, Any]]:
        """One record per round synced: counts, losses, evals before and after, bytes, sync time."""
        return self.book.history

    @property
    def sync_seconds(self) -> float:
        return self.book.sync_seconds

    @property
    def bytes_up(self) -> int:
        """Bytes of updates this participant has uploaded (a group's: all ranks together)."""
        return self.book.bytes_up

    @property
    def bytes_down(self) -> int:
        """Bytes of global models this participant has downloaded (a group's: all ranks together)."""
        return self.book.bytes_down

    def upload_residual(self) -> dict[str, torch.Tensor]:
        """What compressed uploads with error feedback have not sent yet, by tensor name (this
        rank's): save it with the local checkpoint, give it back with `restore_upload_residual`."""
        return self._exchanges.upload_residual()

    def restore_upload_residual(self, tensors: dict[str, torch.Tensor]) -> None:
        """After `__enter__`: take a saved upload residual (ModelMismatchError if it does not fit)."""
        self._exchanges.restore_upload_residual(tensors)

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's snapshot: its rows of the sync set (a replicated rank > 0: none)."""
        return self._engine.snapshot_bytes if self._engine is not None else 0

    @property
    def outages(self) -> list[dict[str, Any]]:
        """Each outage ridden out: {"round", "seconds", "attempts"}."""
        return self._outage.outages

    @property
    def latest_config_version(self) -> int:
        """The newest config version announced by the coordinator (in force from a later round)."""
        return self._presence.latest_config_version if self._presence is not None else self.config_version

    @property
    def events(self) -> list[tuple[str, Any]]:
        """Recent config changes and run events of the coordinator's stream: (kind, data) (rank 0)."""
        return self._presence.events if self._presence is not None else []

    @property
    def sync_in_flight(self) -> bool:
        """Whether an exchange has been sent and has not landed yet."""
        return self._exchanges.pending is not None

    def wait_sync_in_flight(self, timeout_s: float | None = None) -> bool:
        """Block until an exchange in flight has its answer (it lands at the next `step`), or
        `timeout_s` has passed; True when nothing is left running (this rank's)."""
        p = self._exchanges.pending
        if p is None or p.future is None:
            return True
        done, _ = concurrent.futures.wait([p.future], timeout=timeout_s)
        return bool(done)

    @property
    def sync_every(self) -> int:
        """The inner steps of this round: H as the coordinator told it (balanced rounds give each
        participant its own), else train.sync_every; streaming, H/K (a round syncs one fragment)."""
        return self._plan().steps

    def _plan(self) -> Plan:
        h = self.book.told[0] if self.book.told is not None else self.config.train.sync_every
        return Plan.of(self.config, h, self._exchanges.k)

    def on_config_change(self, callback: ConfigCallback) -> ConfigCallback:
        """Call `callback(old, new, diff)` at the round boundary where a new config takes effect
        (diff: dotted field -> [old, new]), on every rank; for fields the user's own loop owns.
        Returns it, so it can decorate a function."""
        return self.book.on_config_change(callback)

    # -- lifecycle --------------------------------------------------------------------------------

    def __enter__(self) -> Participant:
        outcomes, error = self.ranks.together(self._join if self.ranks.lead else None)
        self.ranks.raise_failed(outcomes, error)
        answer = outcomes[0].result
        self.participant_id = answer["participant_id"]
        if self._engine is not None:
            if self.role.kind == "sharded":
                self._engine.who = f"{self.participant_id}.rank{self.rank}"
            if not self.ranks.lead:
                self.client.remember_key(self.participant_id, answer["participant_key"])
                self._engine.prepare(answer["model"])
        self.book.joined(answer)
        version = int(answer["round"]) if self.role.kind == "sharded" else None
        engine = self._engine
        if engine is not None:  # compressed downloads: the whole model now is the one the next delta applies to
            engine.deltas = self.book.config.train.download_compression != "none"
        outcomes, error = self.ranks.together(
            None if engine is None else lambda: engine.download(self.participant_id, version=version,
                                                                transfer=self.book.config.transfer))
        self.ranks.raise_failed(outcomes, error)
        if self._engine is not None:
            self._engine.adopt()
        self.role.landed(None)
        self._exchanges = Exchanges(self._engine, plan_of(answer), self._worker_ranks)  # every fragment's reference
        self._enter_round(self.ranks.agreed(outcomes))
        if self._presence is not None:
            self._presence.note_config_version(self.config_version)
            self._presence.start(self.participant_id)
        log.info("joined as %s at round %d (H=%d)", self._who, self.round, self.sync_every)
        self._pace.resume()
        return self

    @property
    def _who(self) -> str:
        return self.participant_id if self.world_size == 1 else f"rank {self.rank} of {self.participant_id}"

    def _join(self) -> dict[str, Any]:
        """Rank 0: join (as the participant of the key file, if any) and check the run's model."""
        assert self._engine is not None
        try:
            joined = join_as(self.client, self.name, self.info, self.key_file, model=self._engine.sync_spec())
        except CoordinatorError as e:
            if e.code == "model_mismatch":  # refused at the join: nothing of us is in the roster
                raise ModelMismatchError(e.message, details=e.details) from None
            raise
        pid = joined["participant_id"]
        try:
            self._engine.prepare(joined["model"])
        except FedtrainError:
            self._say_goodbye(pid)  # leave no participant behind that will never submit
            raise
        return {"participant_id": pid, "participant_key": self.client.participant_key(pid) or "",
                "config": joined["config"], "config_version": int(joined["config_version"]),
                "round": int(joined["current_round"]), "model": joined["model"],
                "assignment": joined.get("assignment"), "streaming": joined.get("streaming")}

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None and self._exchanges.pending is not None:
                self._land()  # the last exchange in flight lands before we leave
        finally:
            self._exchanges.close()
            if self._presence is not None:
                self._presence.stop()
                if not isinstance(exc[1], faults.InjectedCrash):  # a crashed process says no goodbye
                    self._say_goodbye(self.participant_id)
            self.client.close()
            self.ranks.close()

    def _say_goodbye(self, pid: str) -> None:
        try:
            self.client.leave(pid, retry=self.client.retry.within(2.0))
        except CoordinatorError as e:
            log.info("could not say goodbye to the coordinator: %s", e.message)

    # -- the user's loop ----------------------------------------------------------------------------

    def step(self, tokens: int, loss: float | None = None) -> bool:
        """Count one inner step; sync when the schedule says so. Returns True if a round was
        synced (or, overlapped, sent) at this step."""
        if self.finished:
            return False
        self._pace.stepped()  # the loop's step is timed (and throttled) without the sync
        try:
            return self._step(tokens, loss)
        finally:
            self._pace.resume()

    def _step(self, tokens: int, loss: float | None) -> bool:
        self.steps += 1
        self.book.round_steps += 1
        self._pending[0] += tokens
        self._rate.add(tokens)
        if loss is not None:
            self._last_loss = float(loss)
            self._pending[1] += float(loss)
            self._pending[2] += 1
        plan = self._plan()
        if self.book.round_steps < plan.steps - plan.tau and self._exchanges.pending is None:
            return False  # no collective below the send point
        pending = self._exchanges.pending is not None
        ready = self.ranks.all_true(self._exchanges.ready) if pending else False
        may = self._outage.may_attempt()
        synced = False
        for action in decide(plan, self.book.round_steps, in_flight=pending, ready=ready, may_attempt=may):
            if action == "land":
                synced = self._land() or synced
            elif action == "send":
                self._send()
                synced = synced or not plan.streaming
            else:
                synced = self.sync() or synced
            if self.finished:
                return True
        return synced

    def _take_counts(self) -> int:
        """The group's tokens and losses of the steps since the last sync point, counted; returns
        the tokens not yet sent."""
        summed = self.ranks.sum(self._pending)
        self._pending = [0.0, 0.0, 0.0]
        self.tokens += int(summed[0])
        self._unsent_tokens += int(summed[0])
        self.book.counted(int(summed[0]), summed[1], summed[2])
        return self._unsent_tokens

    def _moved(self, at: tuple[int, int]) -> tuple[int, int]:
        """This rank's bytes up and down since `at`."""
        return self._exchanges.bytes_up - at[0], self._exchanges.bytes_down - at[1]

    def sync(self) -> bool:
        """One blocking exchange of the round's Δ (its fragment's), on every rank: upload, wait for
        the round to close, download, apply. False when the coordinator could not be reached:
        training goes on and the sync is tried again after a backoff (`outage.py`)."""
        t0 = time.perf_counter()
        r = self.round
        unsent = self._take_counts()
        self.role.settle()
        faults.hit("participant.sync", who=self.name or self.participant_id, round=r)
        if self._outage.active and not self._outage.coordinator_back(r):
            return False
        if self._record is None or self._record["round"] != r:  # an attempt after a failed one keeps its record
            self._record = self.book.open(r, self.sync_every)
        record = self._record
        tokens = self.book.tokens_of(r, unsent, fixed=self.role.pieces)
        engine = self._exchanges.engine_of(r)
        at = (self._exchanges.bytes_up, self._exchanges.bytes_down)
        if engine is not None and engine.piece is not None and secagg_on(self.config):  # every rank of an FSDP group
            outcomes, error = exchange_masked_pieces(self.ranks, engine, r, self.participant_id, self.config,
                                                     tokens=tokens, retry=self._attempt_retry)
        else:
            outcomes, error = self.ranks.together(
                None if engine is None else
                lambda: engine.fetch(r, self.participant_id, self.config, tokens=tokens, retry=self._attempt_retry),
                cancel=engine.cancel if engine is not None else None)
        if not all(o.ok for o in outcomes):
            self.book.attempt_failed(r, time.perf_counter() - t0)  # counted in the round's sync_s
            self._outage.failed(r, outcomes, error)
            return False
        self._unsent_tokens = 0
        self._record = None
        version = self._settle(outcomes, engine)
        self._apply(r, version, InFlight(r, self._exchanges.of(r), None, None, record, at))
        self._close(record, r, time.perf_counter() - t0, at)
        return True

    def _close(self, record: dict[str, Any], r: int, blocked_s: float, at: tuple[int, int], reset: bool = True) -> None:
        self.book.close(record, r, blocked_s, self._moved(at), pid=self.participant_id, steps=self.steps,
                        now_in=self.round, finished=self.finished, reset=reset)

    def _send(self) -> None:
        """Take the round's Δ (its fragment's) now and send it on a worker thread (every rank that
        speaks HTTP); training goes on."""
        t0 = time.perf_counter()
        r = self.round
        unsent = self._take_counts()
        self.role.settle()
        faults.hit("participant.sync", who=self.name or self.participant_id, round=r)
        record: dict[str, Any] = {}
        if not self._exchanges.streaming:  # overlapped DiLoCo: the round ends at its send
            record = self.book.open(r, self.sync_every)
            self.book.stamp(record)
            self.book.reset_counts()
        tokens = self.book.tokens_of(r, unsent, fixed=self.role.pieces)
        self._exchanges.send(r, self.participant_id, self.config, tokens=tokens, retry=self._attempt_retry,
                             record=record)
        self._unsent_tokens = 0
        self.book.sync_seconds += time.perf_counter() - t0

    def _land(self) -> bool:
        """Land the exchange in flight (waiting for its answer). False when it failed."""
        t0 = time.perf_counter()
        outcomes, error = self.ranks.together(self._exchanges.result)
        sent = self._exchanges.take()
        r = sent.round
        streaming = self._exchanges.streaming
        if not all(o.ok for o in outcomes):
            self._exchanges.failed(sent, keep_progress=not streaming)
            if streaming:  # the fragment's exchange is tried again, whole, after a backoff
                self.book.attempt_failed(r, time.perf_counter() - t0)
                self._outage.failed(r, outcomes, error)
                return False
            self.ranks.raise_lasting(outcomes, error)  # overlapped DiLoCo: the round's contribution is lost
            log.warning("overlapped sync of round %d failed (%s); continuing from local weights", r,
                        next(o.error for o in outcomes if not o.ok))
            return False
        engine = self._exchanges.engines[sent.fragment] if self._exchanges.engines else None
        version = self._settle(outcomes, engine)
        record = self.book.open(r, self.sync_every) if streaming else sent.record
        self._apply(r, version, InFlight(r, sent.fragment, sent.sent, None, record, sent.bytes_at))
        self._close(record, r, time.perf_counter() - t0, sent.bytes_at, reset=streaming)
        return True

    def _apply(self, r: int, version: int, sent: InFlight) -> None:
        """Round r's result (`version`, in its fragment's snapshot) into the model on every rank:
        replace (blocking), add the progress since the send (overlapped), α-mix (streaming). Past
        r + 1 (rounds went on without us) or at the run's end, streaming: the whole global model."""
        ex = self._exchanges
        engine = ex.engines[sent.fragment] if ex.engines else None
        end = self.config.rounds > 0 and version >= self.config.rounds
        if engine is not None and engine.last_answer is not None and self.role.pieces:
            sent.record["piece"] = engine.last_answer  # the coordinator's answer to our piece
        self.changed = None
        if ex.streaming:
            sent.record["fragment"] = sent.fragment
            alpha = self.config.streaming.alpha if self.config.streaming is not None else 0.0
            if engine is not None:
                engine.mix(alpha)
                self.changed = sorted(engine.params)
            if version not in (r, r + 1) or end:
                if not end:
                    log.warning("round %d ended at version %d: rounds went on without us; taking the global "
                                "model", r, version)
                outcomes, error = self.ranks.together(lambda: ex.take_global(
                    self.participant_id, version, sent.fragment if end else None, retry=self._attempt_retry,
                    transfer=self.book.config.transfer))
                self.ranks.raise_failed(outcomes, error)
                self.changed = None
            if self.role.kind == "replicated":  # the other ranks have no engine: rank 0 names the tensors
                self.changed = self.ranks.broadcast_json(self.changed)
        elif engine is not None:  # the run's end lands on the global model itself
            engine.adopt(None if end else sent.sent)
        self.role.landed(self.changed)
        self._enter_round(version)
        self._outage.ended(r)

    def _enter_round(self, version: int) -> None:
        """The model now holds global version `version`: it is the round we are in (secure
        aggregation: its keys and shares are exchanged and its masks drawn during the inner steps)."""
        self.round = version
        self.finished = self.config.rounds > 0 and version >= self.config.rounds
        engine = self._exchanges.engine_of(version)
        if secagg_on(self.config) and not self.finished and engine is not None and engine.piece is None:
            start_ahead(engine, version, self.participant_id, self.config, self._attempt_retry)

    # -- agreeing ------------------------------------------------------------------------------------

    def _settle(self, outcomes: list[Outcome], engine: Any) -> int:
        """The version the ranks' downloads agree on. The coordinator may commit a round between
        two ranks' downloads (the others went on without us): then every rank fetches the newest
        of the versions they got, so that the shards are of one model."""
        versions = {int(o.result) for o in outcomes if o.result is not None and int(o.result) >= 0}
        if len(versions) > 1:
            newest = max(versions)
            log.info("rank %d: the ranks got versions %s; all take %d", self.rank, sorted(versions), newest)
            outcomes, error = self.ranks.together(
                None if engine is None else lambda: engine.download(self.participant_id, version=newest,
                                                                    transfer=self.book.config.transfer))
            self.ranks.raise_failed(outcomes, error)
        return self.ranks.agreed(outcomes)

    def _heartbeat_stats(self) -> dict[str, Any]:
        """What rank 0's heartbeats tell (read on the heartbeat thread): the group's throughput,
        from rank 0's (the ranks step together)."""
        rate = self._rate.per_second()
        return {"step": self.steps, "round": self.round, "loss": self._last_loss,
                "tokens_per_s": rate * self.world_size if rate is not None else None,
                "steps_per_s": self._pace.steps_per_s, "config_version": self.config_version}

