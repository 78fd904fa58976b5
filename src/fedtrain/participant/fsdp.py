"""FSDP participants: one federated participant whose ranks each sync their own shard.

A model sharded with FSDP2 (`fully_shard`, under torchrun) is one participant: rank 0
joins, sends heartbeats and reports; every rank holds the snapshot of its own rows only
(`shards.py`), uploads Δ of those rows itself as its piece of the participant's update
(`piece=rank<k>`, in parallel with the other ranks), and downloads only its rows of the new
global model (`GET /v1/model?rows=`) into its local shard. No rank ever holds the whole
model: no `full_tensor()`, no gather. The coordinator counts the update once the pieces
cover the sync set (`coordinator/pieces.py`); all pieces carry the group's token count. A
rank's exchange is a `SyncEngine` of its own over its shards (`sync.py`, with a `PieceOf`):
compression and error feedback, resending after a coordinator restart and moving on when
a round closed without us work as they do for one process.

Every collective is entered by every rank in the same order, and every decision is drawn
from facts every rank holds after a collective (`group.py`):

    enter:  TOGETHER(rank 0 joins) ── JSON(id, key, round, config, model | error)
            ── TOGETHER(download our rows) ── adopt
    step:   below H nothing; from H on, each step is a sync point:
            [in an outage: RANK0(attempt now?)] ── SUM(tokens, loss) ── [eval before, on every rank]
            ── TOGETHER(upload our piece, wait for the round, download our rows)
            ── ok everywhere, one version: adopt ── [eval after] ── SUM(bytes)
               ── TOGETHER(rank 0 reports, fetches the round's config) ── JSON(config)
            ── a failure to ride out on any rank: every rank puts its snapshot back, rank 0
               decides when to try again (or to give up) ── JSON(decision)
            ── any other failure: every rank raises

So an outage is ridden out by the group as a whole, as a single process rides it out
(`outage.py`): training goes on, the sync is tried again later, and the group gives up
only when the outage budget is spent. A rank that dies stops the group (torchrun ends the
others; a rank blocked in a collective with a dead peer fails): the coordinator never
merges an update whose pieces are not all in, and drops them when the round closes. The
participant key travels inside the job's process group (same site), never pickled.

Streaming DiLoCo (config `streaming`, τ = 0): every rank builds the fragments' engines from
the join answer's plan (`fragments.py`, `SyncEngine.fragment`), each over the rank's rows of
that fragment's tensors. Round r syncs fragment r mod K after H/K steps: each rank uploads its
rows of the fragment's Δ as its piece (the coordinator counts the update once the pieces cover
the fragment), downloads its rows of that fragment, and mixes them into its shard,
θ^p ← (1 − α)·θ_g^p + α·θ^p. At the run's end (or when rounds went on without us) every rank
takes its rows of the whole global model.

`fedtrain participant --parallel fsdp` (recipes/sharding.py) runs the recipe this way, with
its checkpoints through torch.distributed.checkpoint (`dcp_checkpoint.py`).

Not built: the overlapped sync (`train.overlap` is ignored: FSDP ranks sync blocking), and so
Streaming DiLoCo's τ > 0 (refused at join; a live change to it runs as τ = 0, with a warning),
and `on_config_change` callbacks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fedtrain import faults
from fedtrain.config import RunConfig
from fedtrain.config.changes import config_diff
from fedtrain.errors import ConfigError, CoordinatorError, CoordinatorUnavailable, FedtrainError
from fedtrain.participant.client import CoordinatorClient, RetryPolicy, Timeouts
from fedtrain.participant.distributed import DistributedSyncError
from fedtrain.participant.fragments import FragmentSync, plan_of
from fedtrain.participant.group import Outcome, RankGroup
from fedtrain.participant.keys import join_as
from fedtrain.participant.outage import OutagePolicy, OutageState, is_transient, next_attempt
from fedtrain.participant.pace import told_steps
from fedtrain.participant.presence import Presence, TokenRate
from fedtrain.participant.runner import EvalFn, sync_set
from fedtrain.participant.shards import Shard, local_tensor, reshard, shard_layout
from fedtrain.participant.sync import PieceOf, SyncEngine

__all__ = ["FsdpParticipant"]

log = logging.getLogger("fedtrain.participant")


class _LocalShards(Mapping[str, torch.Tensor]):
    """name -> this rank's local tensor of that parameter, looked up on each use."""

    def __init__(self, params: Mapping[str, nn.Parameter], names: list[str]) -> None:
        self._params = params
        self._names = names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return local_tensor(self._params[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def piece_of(rank: int, params: Mapping[str, nn.Parameter], layout: Mapping[str, Shard]) -> PieceOf:
    """What rank `rank` sends: its rows of each sharded tensor, and (rank 0) the replicated ones."""
    held = {n: s for n, s in layout.items() if not s.empty}
    return PieceOf(
        label=f"rank{rank}",
        sends=frozenset(n for n, s in held.items() if rank == 0 or not s.whole),
        rows={n: (s.start, s.stop) for n, s in held.items() if not s.whole},
        shapes={n: (p.dtype, tuple(p.shape)) for n, p in params.items()},  # a DTensor's shape is global
    )


def fsdp_participant(coordinator: str | CoordinatorClient, model: nn.Module, kwargs: dict[str, Any]) -> FsdpParticipant:
    """`Participant(coordinator, model=<a fully_shard model>, **kwargs)`: the same arguments, for
    an FSDP participant (`Participant.__new__` hands them here)."""
    if isinstance(coordinator, CoordinatorClient):
        client = coordinator
    else:
        if kwargs.get("token") is None:
            raise ValueError("Participant needs token= when given a coordinator URL")
        client = CoordinatorClient(coordinator, kwargs["token"], timeouts=kwargs.get("timeouts", Timeouts()),
                                   retry=kwargs.get("retry", RetryPolicy()), verify=kwargs.get("verify", True))
    given = {k: kwargs[k] for k in ("name", "info", "eval_fn", "inner_optimizer", "key_file", "outage")
             if k in kwargs}
    return FsdpParticipant(model, client=client, **given)


class FsdpParticipant:
    """A participant made of the ranks of an FSDP2 job, each syncing its own shard.

    Construct it on every rank with the same arguments and a `CoordinatorClient` of the
    rank's own; `model` is the `fully_shard`ed module (its trainable parameters are the
    sync set). `eval_fn(model)` runs on every rank (an FSDP forward is collective); the
    ranks' results are averaged. `key_file` (rank 0's) keeps the participant key, so that a
    restarted group rejoins as itself. The loop-facing surface is `Participant`'s: `step`,
    `finished`, `round`, `config`, `sync_every`, `steps`, `tokens`, `history`."""

    def __init__(self, model: nn.Module, *, client: CoordinatorClient, name: str | None = None,
                 info: dict[str, Any] | None = None, eval_fn: EvalFn | None = None,
                 inner_optimizer: torch.optim.Optimizer | None = None, key_file: str | Path | None = None,
                 group: dist.ProcessGroup | None = None, keepalive_s: float = 5.0,
                 patience_s: float = 60.0, outage: OutagePolicy = OutagePolicy()) -> None:
        if not dist.is_initialized():
            raise FedtrainError("FsdpParticipant needs torch.distributed initialised (run under torchrun)")
        self.client = client
        self.name = name
        self.ranks = RankGroup(group, keepalive_s)
        self.rank, self.world_size = self.ranks.rank, self.ranks.world_size
        self.info = {**(info or {}), "parallel": "fsdp", "world_size": self.world_size}
        self.model = model
        self.eval_fn = eval_fn
        self.inner_optimizer = inner_optimizer
        self.key_file = Path(key_file) if key_file is not None and self.rank == 0 else None
        self.outage_policy = outage
        self._outage = OutageState()
        self._outage_budget_s = outage.budget_s if outage.budget_s is not None else client.retry.max_elapsed_s
        self._attempt_retry = client.retry.within(outage.attempt_s)
        self.outages: list[dict[str, Any]] = []
        params = sync_set(model)
        layout = shard_layout(params)
        held = sorted(n for n, s in layout.items() if not s.empty)
        self._engine = SyncEngine(client, _LocalShards(params, held), who=f"{name or 'fsdp'}.rank{self.rank}",
                                  patience_s=patience_s, piece=piece_of(self.rank, params, layout))
        self._engine.wait_s = max(1.0, min(25.0, 2 * keepalive_s))  # a rank's failure cuts our wait this soon
        self._fragments: FragmentSync | None = None  # Streaming DiLoCo: the fragments' engines, from the join
        self.participant_id = ""
        self.config = RunConfig()
        self.config_version = 0
        self.round = 0
        self.finished = False
        self.steps = 0
        self.tokens = 0
        self.bytes_up = 0  # the group's, all ranks together
        self.bytes_down = 0
        self.sync_seconds = 0.0
        self.history: list[dict[str, Any]] = []
        self._round_steps = 0
        self._round_tokens = 0
        self._round_loss = [0.0, 0.0]  # sum, count: the group's, over the round's attempts
        self._pending = [0.0, 0.0, 0.0]  # this rank's tokens, loss sum, loss count not yet summed
        self._record: dict[str, Any] | None = None  # the round's record, from its first attempt
        self._last_loss: float | None = None
        self._rate = TokenRate()
        self._presence: Presence | None = None
        self._told: tuple[int, str] | None = None  # this round's H and why, as the coordinator told it
        if self.rank == 0:
            self._presence = Presence(client, interval_s=lambda: self.config.heartbeat_interval_s,
                                      stats=self._heartbeat_stats)

    @property
    def sync_every(self) -> int:
        """The inner steps of this round: H, or streaming H/K (a round syncs one fragment)."""
        h = self._told[0] if self._told is not None else self.config.train.sync_every
        return h // self._fragments.k if self._fragments is not None else h

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's snapshot: its rows of the sync set."""
        return self._engine.snapshot_bytes

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> FsdpParticipant:
        outcomes, error = self.ranks.together(self._join if self.rank == 0 else None)
        self._raise_failed(outcomes, error)
        answer = self.ranks.broadcast_json(outcomes[0].result)
        self.participant_id = answer["participant_id"]
        self._engine.who = f"{self.participant_id}.rank{self.rank}"
        self.client.remember_key(self.participant_id, answer["participant_key"])
        self.config = RunConfig.model_validate(answer["config"])
        self.config_version = int(answer["config_version"])
        self._told = told_steps(answer)
        self._engine.prepare(answer["model"])
        version = int(answer["round"])
        outcomes, error = self.ranks.together(lambda: self._engine.download(self.participant_id, version=version))
        self._raise_failed(outcomes, error)
        self._engine.adopt()
        plan = plan_of(answer)
        if plan is not None:  # every fragment's reference is the global model just adopted
            self._fragments = FragmentSync(self._engine, plan)
        self._enter_round(self._agreed(outcomes))
        if self._presence is not None:
            self._presence.note_config_version(self.config_version)
            self._presence.start(self.participant_id)
            if self.config.train.overlap:
                log.warning("train.overlap is on, but FSDP participants sync blocking")
        log.info("rank %d of %s joined at round %d, holding %d bytes of the sync set", self.rank,
                 self.participant_id, self.round, self.shard_bytes)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._presence is not None:
            self._presence.stop()
            if not isinstance(exc[1], faults.InjectedCrash):  # a crashed process says no goodbye
                try:
                    self.client.leave(self.participant_id, retry=self.client.retry.within(2.0))
                except FedtrainError as e:
                    log.info("could not say goodbye to the coordinator: %s", e)
        if self._fragments is not None:
            self._fragments.close()
        self.client.close()

    # -- the user's loop -------------------------------------------------------------------

    def step(self, tokens: int, loss: float | None = None) -> bool:
        """Count one inner step on this rank; from the H-th step of a round on, every rank syncs
        its shard (see the module docstring). Returns True when the group synced."""
        if self.finished:
            return False
        self.steps += 1
        self._round_steps += 1
        self._pending[0] += tokens
        self._rate.add(tokens)
        if loss is not None:
            self._last_loss = float(loss)
            self._pending[1] += float(loss)
            self._pending[2] += 1
        if self._round_steps < self.sync_every:
            return False
        if self._outage.active and not self.ranks.rank0_says(time.monotonic() >= self._outage.next_at):
            return False
        return self.sync()

    def sync(self) -> bool:
        """One sync attempt of the whole group (every rank calls it at the same step). False
        when the coordinator could not be reached: training goes on, tried again later."""
        t0 = time.perf_counter()
        summed = self.ranks.sum(self._pending)
        self._pending = [0.0, 0.0, 0.0]
        self._round_tokens += int(summed[0])
        self._round_loss = [self._round_loss[0] + summed[1], self._round_loss[1] + summed[2]]
        r = self.round
        reshard(self.model)  # the shards are what we send and what the new weights go into
        faults.hit("participant.sync", who=self._engine.who, round=r)
        record = self._record = self._record or self._open_record(r)
        # Every attempt at round r sends the tokens of the first: a piece of it may be in already,
        # and the pieces of one update carry one count.
        tokens = record.setdefault("tokens", max(1, self._round_tokens))
        engine = self._engine if self._fragments is None else self._fragments.engines[self._fragments.of(r)]
        outcomes, error = self.ranks.together(
            lambda: engine.fetch(r, self.participant_id, self.config, tokens=tokens, retry=self._attempt_retry),
            cancel=engine.cancel)
        if not all(o.ok for o in outcomes):
            self._failed(r, outcomes, error)
            return False
        version = self._settle(outcomes, engine)
        record["piece"] = engine.last_answer
        if self._fragments is None:
            engine.adopt()
        else:
            version = self._mix(r, version)
        self._enter_round(version)
        ended, self._outage = self._outage.ended(r, quiet=self.rank != 0), OutageState()
        if ended is not None:
            self.outages.append(ended)
        self.tokens += self._round_tokens
        self._close_record(record, r, time.perf_counter() - t0)
        return True

    # -- one round's record ---------------------------------------------------------------------

    def _open_record(self, r: int) -> dict[str, Any]:
        up, down = self._moved()
        record: dict[str, Any] = {"round": r, "config_version": self.config_version, "sync_every": self.sync_every,
                                  "_up0": up, "_down0": down}
        if self._fragments is not None:
            record["fragment"] = self._fragments.of(r)
        if self.eval_due(r):
            record.update(self._evaluate("eval_before"))
        return record

    def _close_record(self, record: dict[str, Any], r: int, blocked_s: float) -> None:
        """After the new global weights are in: eval after, the group's bytes, report, the new config."""
        if self.eval_due(r):
            record.update(self._evaluate("eval_after"))
        moved = self._moved()
        up, down = self.ranks.sum([moved[0] - record.pop("_up0"), moved[1] - record.pop("_down0")])
        self.bytes_up += int(up)
        self.bytes_down += int(down)
        record.update(steps=self._round_steps, bytes_up=int(up), bytes_down=int(down), sync_s=blocked_s)
        if self._round_loss[1] > 0:
            record["train_loss"] = self._round_loss[0] / self._round_loss[1]
        self.sync_seconds += blocked_s
        self.history.append(record)
        self._record = None
        self._round_steps, self._round_tokens, self._round_loss = 0, 0, [0.0, 0.0]
        outcomes, error = self.ranks.together(lambda: self._report_and_config(record) if self.rank == 0 else None)
        self._raise_failed(outcomes, error)
        view = self.ranks.broadcast_json(outcomes[0].result)
        if view is not None:
            self._told = told_steps(view)
            if int(view["version"]) != self.config_version:
                self._apply_config(view)

    def _report_and_config(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """Rank 0: report the round's metrics; the config view of the round we are now in (None:
        unchanged, or unreachable for now, which keeps the current one)."""
        values = {k: float(v) for k, v in record.items()
                  if k not in ("round", "steps", "config_version", "sync_every", "piece", "fragment")}
        try:
            self.client.report(self.participant_id, values, round_=record["round"], step=self.steps,
                               retry=self._attempt_retry)
        except CoordinatorError as e:
            log.warning("could not report metrics of round %d: %s", record["round"], e.message)
        if self.finished:
            return None
        try:
            view = self.client.get_config(round_=self.round, participant_id=self.participant_id,
                                          retry=self._attempt_retry)
        except CoordinatorError as e:
            if not is_transient(e):
                raise
            log.warning("could not fetch the config of round %d (%s); keeping the current one", self.round, e.message)
            return None
        changed = int(view["version"]) != self.config_version or told_steps(view) != self._told
        return dict(view) if changed else None

    def _apply_config(self, view: dict[str, Any]) -> None:
        """On every rank: the config in force for the round we now start."""
        old, new = self.config, RunConfig.model_validate(view["config"])
        diff = config_diff(old.model_dump(mode="json"), new.model_dump(mode="json"))
        self.config, self.config_version = new, int(view["version"])
        if self._fragments is not None and new.streaming is not None and new.streaming.overlap > 0 and \
                self._presence is not None:
            log.warning("streaming.overlap is %d, but FSDP participants sync each fragment blocking, at step H/K "
                        "(as with overlap 0)", new.streaming.overlap)
        if "train.lr" in diff and self.inner_optimizer is not None:
            for group in self.inner_optimizer.param_groups:
                group["lr"] = new.train.lr
        if self._presence is not None:
            self._presence.note_config_version(self.config_version)
            log.info("config v%d in force from round %d: %s", self.config_version, self.round,
                     ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items()))

    def eval_due(self, r: int) -> bool:
        """Whether round `r` is evaluated around its sync: every `eval.every` rounds, and the last."""
        last = self.config.rounds > 0 and r + 1 >= self.config.rounds
        return self.eval_fn is not None and (r % self.config.eval.every == 0 or last)

    def _evaluate(self, prefix: str) -> dict[str, float]:
        """`eval_fn` on every rank, averaged over the ranks (the keys are rank 0's)."""
        assert self.eval_fn is not None
        result = self.eval_fn(self.model)
        reshard(self.model)  # an eval's forward leaves the root gathered (`shards.reshard`)
        values = result if isinstance(result, dict) else {"loss": result}
        keys = self.ranks.broadcast_json(sorted(values))
        if sorted(values) != keys:
            raise DistributedSyncError(f"rank {self.rank}'s eval_fn returned {sorted(values)}, rank 0's {keys}")
        means = self.ranks.sum([float(values[k]) for k in keys])
        return {f"{prefix}/{k}": v / self.world_size for k, v in zip(keys, means, strict=True)}

    # -- joining, failing, agreeing -----------------------------------------------------------------

    def _join(self) -> dict[str, Any]:
        """Rank 0: join (as the participant of the key file, if any) and check the run's model."""
        joined = join_as(self.client, self.name, self.info, self.key_file)
        pid = joined["participant_id"]
        streaming = RunConfig.model_validate(joined["config"]).streaming
        tau = streaming.overlap if streaming is not None else 0
        if tau > 0:
            self.client.leave(pid, retry=self.client.retry.within(2.0))
            raise ConfigError(f"this run streams with overlap tau = {tau}, and FSDP participants sync each fragment "
                              "blocking (tau = 0 only): set streaming.overlap to 0, or train with DDP "
                              "(--parallel ddp) or one process per site")
        self._engine.check_model(joined["model"])
        return {"participant_id": pid, "participant_key": self.client.participant_key(pid) or "",
                "config": joined["config"], "config_version": int(joined["config_version"]),
                "round": int(joined["current_round"]), "model": joined["model"],
                "assignment": joined.get("assignment"), "streaming": joined.get("streaming")}

    def _failed(self, r: int, outcomes: list[Outcome], error: BaseException | None) -> None:
        """A sync attempt failed on some rank: ride it out as a group (every rank's engine has put
        its snapshot back), or raise on every rank when the failure is not one to ride out."""
        if not all(o.ok or o.transient for o in outcomes):
            self._raise_failed(outcomes, error)
        failed = [o for o in outcomes if not o.ok]
        first = next((o for o in failed if o.code != "cancelled"), failed[0])
        decision = None
        if self.rank == 0:
            now = time.monotonic()
            self._outage.last_error = f"rank {first.rank}: {first.error}"
            attempt = next_attempt(self._outage, now, self.outage_policy, self._outage_budget_s)
            decision = {"action": attempt.action, "reason": attempt.reason}
            if attempt.action != "give_up":
                self._outage.next_at = now + attempt.delay_s
                log.warning("round %d: %s", r, attempt.reason)
        decision = self.ranks.broadcast_json(decision)
        if decision["action"] == "give_up":
            raise CoordinatorUnavailable(decision["reason"], status=0, code="unavailable")
        if self._outage.since is None:
            self._outage.since = time.monotonic()
        self._outage.attempts += 1

    def _raise_failed(self, outcomes: list[Outcome], error: BaseException | None) -> None:
        """Raise on every rank if any rank's work failed: its own error where it failed."""
        failed = [o for o in outcomes if not o.ok]
        if error is not None:
            raise error
        if failed:
            raise DistributedSyncError("; ".join(f"rank {o.rank} of this participant failed: {o.error}"
                                                 for o in failed))

    def _agreed(self, outcomes: list[Outcome]) -> int:
        """The global version every rank holding rows downloaded (-1 on a rank with none)."""
        versions = {int(o.result) for o in outcomes if o.result is not None and int(o.result) >= 0}
        if len(versions) != 1:
            raise DistributedSyncError(f"the ranks of this participant downloaded different global versions "
                                       f"({sorted(versions)})")
        return versions.pop()

    def _settle(self, outcomes: list[Outcome], engine: SyncEngine) -> int:
        """The version the ranks' downloads agree on. The coordinator may commit a round between
        two ranks' downloads (the others went on without us): then every rank fetches the
        newest of the versions they got, by number, so that the shards are of one model."""
        versions = {int(o.result) for o in outcomes if o.result is not None and int(o.result) >= 0}
        if len(versions) > 1:
            newest = max(versions)
            log.info("rank %d: the ranks got versions %s; all take %d", self.rank, sorted(versions), newest)
            outcomes, error = self.ranks.together(lambda: engine.download(self.participant_id, version=newest))
            self._raise_failed(outcomes, error)
        return self._agreed(outcomes)

    def _mix(self, r: int, version: int) -> int:
        """Streaming, on every rank: round r's fragment into our shard, θ ← (1 − α)·θ_g + α·θ
        (`SyncEngine.mix`). Past round r + 1 (rounds went on without us) or at the run's end,
        every fragment takes global version `version` whole, as a single process's does."""
        assert self._fragments is not None
        alpha = self.config.streaming.alpha if self.config.streaming is not None else 0.0
        self._fragments.mix(self._fragments.of(r), alpha)
        if version not in (r, r + 1):
            log.warning("round %d ended at version %d: rounds went on without us; taking the global model", r, version)
        elif not (self.config.rounds > 0 and version >= self.config.rounds):
            return version
        outcomes, error = self.ranks.together(lambda: self._engine.download(self.participant_id, version=version))
        self._raise_failed(outcomes, error)
        self._engine.adopt()
        return self._agreed(outcomes)

    def _moved(self) -> tuple[int, int]:
        """This rank's bytes up and down so far, its fragments' engines' included."""
        fs = self._fragments
        return (self._engine.bytes_up + (fs.bytes_up if fs is not None else 0),
                self._engine.bytes_down + (fs.bytes_down if fs is not None else 0))

    def _enter_round(self, version: int) -> None:
        self.round = version
        self.finished = self.config.rounds > 0 and version >= self.config.rounds

    def _heartbeat_stats(self) -> dict[str, Any]:
        """What rank 0's heartbeats tell: the group's throughput, from rank 0's (the ranks step together)."""
        rate = self._rate.per_second()
        return {"step": self.steps, "round": self.round, "loss": self._last_loss,
                "tokens_per_s": rate * self.world_size if rate is not None else None,
                "config_version": self.config_version}
