"""Moving the run from round to round: close the open round, merge and commit it, or go back.

`Rounds` owns the open round (`OpenRound`), the close, the background commit of the round
before and the periodic tick; going back is `GoingBack`'s (`going_back.py`). Whether to close is
`policy.decide_round`'s decision.

More: docs/architecture.md, "coordinator/rounds/progress.py".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedtrain import faults
from fedtrain.config import OuterConfig, RunConfig
from fedtrain.config.privacy import dp_on, secagg_on
from fedtrain.coordinator import policy
from fedtrain.coordinator.intake.flow import Intake, MergeInputs
from fedtrain.coordinator.members.roster import Roster
from fedtrain.coordinator.model.committer import Committer
from fedtrain.coordinator.model.publish import ModelStream, Published
from fedtrain.coordinator.model.slices import SliceStream
from fedtrain.coordinator.policy import async_rules
from fedtrain.coordinator.rounds.fragment_plan import Fragment, FragmentPlan
from fedtrain.coordinator.rounds.going_back import GoingBack, RoundMoves
from fedtrain.coordinator.rounds.open_round import OpenRound
from fedtrain.coordinator.secagg import SecAggRefused, SecureAggregation
from fedtrain.coordinator.state.config_versions import ConfigVersions
from fedtrain.coordinator.state.events import Events
from fedtrain.coordinator.state.store import Store
from fedtrain.errors import MergeError, Refused
from fedtrain.merge import OuterOptimizer, contribution_weights
from fedtrain.merge.outer import NonFiniteStep
from fedtrain.privacy.central import CentralDp

log = logging.getLogger("fedtrain.coordinator")

#: The newest committed rounds over which each participant's share of the applied weight is shown.
SHARE_WINDOW = 100


class PoisonedMerge(MergeError):
    """A round's merge was not finite; `key` names the update refused for it (`largest_influence`)."""

    def __init__(self, message: str, key: str, round_: int, why: str) -> None:
        super().__init__(message)
        self.key, self.round, self.why = key, round_, why


@dataclass(frozen=True)
class Merged:
    """What a merge made (worker thread), for the event loop to put in force."""

    record: dict[str, Any]
    published: Published
    inputs: MergeInputs


@dataclass(frozen=True)
class Step:
    """How a round's outer step is taken: on the mean times `scale`, with the delayed Nesterov
    step's N `every`, and the `weights` recorded (None: `round_weights`). Asynchronous mode
    sets them from the update's staleness (`async_rules`); the defaults are a round's."""

    scale: float = 1.0
    every: int | None = None
    weights: dict[str, float] | None = None


def round_weights(tokens: dict[str, int], rejected: dict[str, str], outer: OuterConfig) -> dict[str, float]:
    """Recorded weights: normalised over the kept updates (uniform for median/trimmed mean),
    capped at outer.max_share for the weighted mean (`policy.cap_shares`), 0 if left out."""
    kept = {k: v for k, v in tokens.items() if k not in rejected}
    mode = outer.weighting if outer.aggregator == "mean" else "uniform"
    weights = contribution_weights(kept, mode) if kept else {}
    if weights and outer.aggregator == "mean":
        weights = policy.cap_shares(weights, outer.max_share)[0]
    weights.update({k: 0.0 for k in tokens if k in rejected})
    return weights


class Rounds:
    """The open round and the moves from one round to the next."""

    def __init__(self, open_round: OpenRound, roster: Roster, configs: ConfigVersions, intake: Intake,
                 committer: Committer, store: Store, events: Events, clock: Callable[[], float],
                 plan: FragmentPlan | None = None) -> None:
        self.open = open_round
        self.plan = plan  # Streaming DiLoCo: round r syncs fragment r mod K (None: every round the whole set)
        self._roster = roster
        self._configs = configs
        self._intake = intake
        self._committer = committer
        self._store = store
        self._events = events
        self.clock = clock
        self.back = GoingBack(open_round, configs, intake, committer, events, clock,  # roll backs (`going_back.py`)
                              RoundMoves(self._end_round, self._settle_commit, self.enter_round, self._privacy_meta))
        self._close_task: asyncio.Task[None] | None = None
        self._commit_task: asyncio.Task[None] | None = None  # the commit of the open round's predecessor
        self._tick_task: asyncio.Task[None] | None = None
        self.staleness_of: dict[str, int] = {}  # asynchronous mode: each participant's last applied staleness
        cfg = configs.config  # central DP: its settings are fixed for the run (config/privacy.py)
        self.privacy = CentralDp(cfg.privacy, cfg.rounds, committer.privacy_rounds()) if dp_on(cfg) else None
        # secure aggregation (fixed for the run): uploads are masked, the merge takes the unmasked mean
        self.secagg = SecureAggregation(
            cfg.privacy, cfg.name, self._synced_shapes, open_round.version, events, clock, roster.active,
            self._count_tokens,
            lambda claims: round_weights(claims, {}, self._configs.config.outer)) if secagg_on(cfg) else None
        intake.masked = self.secagg
        intake.select(self.fragment(open_round.version))

    # -- reading --------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The open round's number."""
        return self.open.version

    @property
    def finished(self) -> bool:
        """The configured rounds are done, or (central DP) one more round would pass the ε budget."""
        dp_done = self.privacy is not None and self.privacy.exhausted()
        return dp_done or policy.run_finished(self.open.version, self._configs.config)

    def deadline(self) -> tuple[float, str]:
        return self.open.deadline(self._configs.config)

    def _synced_shapes(self, round_: int) -> dict[str, tuple[int, ...]]:
        """The tensors round `round_` syncs (its fragment's, streaming), by name: what it masks."""
        params, fragment = self._committer.model.params, self.fragment(round_)
        return {n: tuple(params[n].shape) for n in (fragment.names if fragment is not None else params)}

    def fragment(self, round_: int) -> Fragment | None:
        """The Streaming DiLoCo fragment round `round_` syncs (None: streaming is off)."""
        return self.plan.fragment(round_) if self.plan is not None else None

    def decide(self) -> policy.Decision:
        cfg = self._configs.config
        if self.secagg is not None and self.secagg.all_in(set(self.open.submitted)):
            return policy.Decision("close", "every participant of the round's secure aggregation uploaded")
        if cfg.schedule.mode == "async":
            return async_rules.decide(self.open.version, self.open.staleness, cfg)
        return policy.decide_round(self.open.view(self.deadline()[0]), self._roster.views(), self.clock(),
                                   self._configs.config)

    def round_info(self, round_: int, pid: str | None = None,
                   piece_in: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Round `round_`'s state; `submitted`: whether `pid`'s update is in the open round (or,
        with `piece_in`, that its update is in or the piece `piece_in` asks after is)."""
        open_ = self.open
        state, _ = policy.round_state(round_, open_.version, self._committer.committed_version, open_.closing,
                                      self.finished)
        return {
            "round": round_,
            "state": state,
            "current_round": open_.version,
            "finished": self.finished,
            "submitted": self._submitted(round_, pid, piece_in) if pid else None,
            "n_submitted": len(open_.submitted) if round_ == open_.version else None,
            "n_active": len(self._roster.active()),
            "reason": open_.reason,
            "config_version": self._configs.version,
            "fragment": self.plan.of(round_) if self.plan is not None else None,
        }

    def _submitted(self, round_: int, pid: str, piece_in: Callable[[], bool] | None) -> bool | None:
        if round_ != self.open.version:
            return None
        return pid in self.open.submitted or (piece_in is not None and piece_in())

    async def wait_round(self, pid: str | None, round_: int, wait_s: float,
                         piece_in: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Long-poll: answer as soon as round `round_` is closed (committed), or after `wait_s`.
        A participant (`pid`) is answered as soon as the round is merged ("committing"): its
        next step, the download of the new model, completes once the round is committed."""
        if round_ > self.version:
            raise Refused(409, "round_not_open", f"round {round_} has not opened; the current round is "
                                                 f"{self.version}", {"current_round": self.version})

        def pending() -> bool:
            if round_ == self.version:
                return not self.finished
            return pid is None and self._committer.committed_version <= round_ < self.version  # merged, committing

        deadline = time.monotonic() + max(0.0, min(wait_s, 60.0))
        while pending():
            if pid is not None and not self.open.closing and self._submitted(round_, pid, piece_in) is False:
                break  # its upload is missing (lost, or dropped by a restart): answer now so it resends
            if not await self._events.wait_changed(deadline - time.monotonic()):
                break
        return self.round_info(round_, pid, piece_in)

    def schedule_view(self) -> dict[str, dict[str, Any]]:
        """Per participant: the staleness of its last applied update (asynchronous mode; None
        when not known since the start), and its updates and share of the applied weight over
        the last SHARE_WINDOW committed rounds (of the recorded weights: a round's shares, or in
        asynchronous mode each update's staleness weight)."""
        applied = self._store.applied(SHARE_WINDOW)
        total = sum(w for _, w in applied.values())
        return {pid: {"staleness": self.staleness_of.get(pid),
                      "applied": applied.get(pid, (0, 0.0))[0],
                      "share": applied[pid][1] / total if pid in applied and total > 0 else None}
                for pid in self._roster.rows}

    def model_stream(self, version: int | None) -> ModelStream:
        """A download of global version `version` (default: the newest)."""
        return self._committer.model_stream(self.version if version is None else version)

    async def model_slice(self, version: int | None, rows: str) -> SliceStream:
        """A download of rows `rows` of global version `version` (default: the newest)."""
        return await self._committer.model_slice(self.version if version is None else version, rows)

    # -- the tick ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._tick_task = asyncio.create_task(self._ticker())

    def tick(self) -> None:
        """Periodic duties: fail silent participants, close rounds whose deadline passed."""
        failed = self._roster.fail_silent(self._configs.config)
        for pid in failed:
            self._intake.abort_direct(pid)
        if self.secagg is not None and not self.open.closing:
            self.secagg.tick()
        self.maybe_close()
        if failed:
            self._events.notify()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                self.tick()
            except Exception:
                log.exception("coordinator tick failed")

    async def stop(self) -> None:
        if self._commit_task is not None:  # a published round is committed before we go
            await asyncio.gather(self._commit_task, return_exceptions=True)
        for task in (self._tick_task, self._close_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # shutting down: nothing to report
                    await task
        await self._intake.stop()

    # -- closing ----------------------------------------------------------------------------------

    def maybe_close(self) -> None:
        if self.open.closing or self.finished:
            return
        decision = self.decide()
        self.open.reason = decision.reason
        if decision.action == "close":
            self.open.closing = True
            self._intake.abort_direct()
            self._close_task = asyncio.create_task(self._close_round(decision.reason))

    def enter_round(self) -> None:
        """At a round boundary: the newest config version meant for the open round comes into force."""
        if self._configs.enter(self.version):
            self._committer.reconfigure(self._configs.config)
            self._events.publish("config", self._configs.view(None, self.version))

    async def _close_round(self, reason: str) -> None:
        await self._intake.idle()
        if not await self._settle_commit():
            self.open.closing = False
            self._events.notify()
            return
        r = self.version
        cfg = self._configs.config
        tokens, staleness = dict(self.open.submitted), dict(self.open.staleness)
        step = Step()
        if cfg.schedule.mode == "async":
            step = Step(async_rules.scale(tokens, staleness, cfg),
                        async_rules.momentum_period(len(self._roster.active()), cfg)[0],
                        {k: async_rules.weight(staleness.get(k, 0), cfg)[0] for k in tokens})
        try:
            if self.secagg is not None:  # the survivors reveal their shares before the merge unmasks
                await self.secagg.unmask()
            merged = await asyncio.to_thread(self._merge, r, reason, tokens, cfg, step)
        except SecAggRefused as e:
            self._refuse_secagg(r, e.message)
            return
        except PoisonedMerge as e:
            pid = e.key.split("@")[0]
            why = (f"the update of {pid} for round {e.round} was refused: the merge it took part in was not finite "
                   f"({e.message}), and {e.why}")
            self._intake.bar(e.round, pid, why)
            self._events.record("refuse", why, pid)
            await self.back.roll_back(f"the merge of round {r} was not finite", "merge_refused")
            return
        except Exception as e:
            log.exception("merge of round %d failed", r)
            await self.back.roll_back(f"merge of round {r} failed ({e})", "merge_failed")
            return
        record = merged.record
        self.staleness_of.update(staleness)
        self._committer.serve(merged.published)
        for key, why in merged.inputs.rejected.items():
            self._events.record("reject", f"the update of {key} for round {r} was left out: {why}", key.split("@")[0])
        for key, why in merged.inputs.capped.items():
            self._events.record("cap", f"the update of {key} for round {r}: {why}", key.split("@")[0])
        # The commit writes this optimizer and the served body, whatever config the next round
        # brings in (`enter_round` may replace the optimizer before the commit is done).
        outer = self._committer.model
        self._commit_task = asyncio.create_task(self._commit_in_background(r, record, merged.published, outer))
        self._end_round(r + 1, self.clock(), committed=True)
        self.open.closing = False
        self.enter_round()
        self.open.reason = "run finished" if self.finished else "round opened"
        spent_now = f"; (ε, δ) = ({self.privacy.epsilon:.4g}, {self.privacy.config.delta:g})" if self.privacy else ""
        self._events.record(
            "round", f"round {r} closed: {reason}; {record['n_submissions']} updates, merge {record['merge_s']:.2f}s"
            + spent_now)
        if self.finished:
            dp = self.privacy
            spent = (f": the ε budget {dp.config.epsilon_budget:g} is spent (ε {dp.epsilon:.4g} after {dp.rounds} "
                     "rounds merged with noise)" if dp is not None and dp.exhausted() else "")
            self._events.record("finished", f"run finished after {self.version} rounds{spent}")
        self._events.notify()

    def _merge(self, r: int, reason: str, tokens: dict[str, int], cfg: RunConfig, step: Step) -> Merged:
        """Worker thread: aggregate the round, take the outer step (as `step` says: asynchronous
        mode scales it) and make a body over the new weights (held back until committed unless
        `publish_first`)."""
        t0 = time.perf_counter()
        intake, fragment = self._intake, self.fragment(r)
        with intake.fold_lock:
            faults.hit("merge.before_step", round=r)
            if self.secagg is not None:  # the unmasked mean, as the sum's one contribution (SecAggRefused)
                inputs = MergeInputs(self.secagg.aggregate_into(intake.sum), {}, {}, {})
            else:
                inputs = intake.merge_inputs(cfg)
            weights = round_weights(tokens, inputs.rejected, cfg.outer) if step.weights is None else step.weights
            dp = self.privacy  # central DP: noise σ·w_max·C on the mean (of the fragment's tensors only)
            central = dp is not None and self.secagg is None  # (with secure aggregation the participants add it)
            noise = dp.noise_std(inputs.shares) if central and dp is not None else 0.0
            try:  # streaming: the fragment's parameters only, each fragment with its own optimizer state
                self._committer.step(intake.sum, step.scale, step.every, fragment.names if fragment else None,
                                     noise_std=noise)
            except NonFiniteStep as e:
                key, why = policy.largest_influence(inputs.shares, inputs.largest)
                round_ = int(key.split("@late")[1]) if "@late" in key else r
                raise PoisonedMerge(e.message, key, round_, why) from None
            intake.sum.reset()
        if dp is not None:  # counted once merged: a round rolled back after this may have been served
            dp.record_round()
        record = {
            "round": r,
            "opened_at": self.open.opened_at,
            "closed_at": self.clock(),
            "close_reason": reason,
            "algorithm": self._committer.model.algorithm,
            "n_submissions": len(tokens),
            "tokens": policy.bounded_sum(tokens.values()),
            "bytes_in": policy.bounded_sum(s["bytes"] for s in self._store.submissions(r)),
            "weights": weights,
            **({"fragment": fragment.index} if fragment is not None else {}),
        }
        published = self._committer.publish(r + 1, cfg, hold=not cfg.publish_first, extra=self._privacy_meta())
        record["merge_s"] = time.perf_counter() - t0
        return Merged(record, published, inputs)

    def _end_round(self, version: int, now: float | None, committed: bool) -> None:
        """Round `version` is the open one now: the one before was merged (`committed`) or gone
        back; its late folds and retained updates go, and the intake takes its fragment's tensors."""
        self.open.next(version, now, committed)
        cfg = self._configs.config
        self._intake.clear(committed, oldest_round=version - max(cfg.max_staleness, cfg.asynchronous.max_staleness))
        self._intake.select(self.fragment(version))
        if self.secagg is not None:
            self.secagg.open_round(version)

    def _refuse_secagg(self, r: int, why: str) -> None:
        """Round r's secure aggregation could not unmask: the round is not committed (nothing
        changed), and it opens again with a fresh attempt; its participants' updates are dropped
        and they find round r open again (their next download is the same version)."""
        self._events.record("secagg_refused", f"round {r} refused: {why}; it opens again with fresh keys")
        try:  # its submissions are not the round's any more: the next attempt's are
            self._store.discard_uncommitted(r)
        except sqlite3.Error as e:
            log.warning("the submissions of refused round %d could not be forgotten: %s", r, e)
        self._end_round(r, self.clock(), committed=False)
        self.open.closing = False
        self.open.reason = f"round opened again: {why}"
        if self.secagg is not None:
            self.secagg.refused += 1
        self._events.notify()

    def _count_tokens(self, pid: str, round_: int, claimed: int) -> int:
        """The tokens a claim counts as (`policy.count_tokens`, as an upload's are counted)."""
        told = self._store.assignments(round_).get(pid)
        cfg = self._configs.for_round(round_, self.version)
        return policy.count_tokens(claimed, cfg, told["sync_every"] if told is not None else None)[0]

    async def _commit_in_background(self, r: int, record: dict[str, Any], published: Published,
                                    outer: OuterOptimizer) -> None:
        """Commit round r while round r + 1 runs; if that fails, go back to the last committed
        round at once (what was served of r + 1 is dropped, and held downloads of it are cut short)."""
        keep = self._configs.config.keep_checkpoints
        try:
            await asyncio.to_thread(self._committer.commit, r, record, published, outer, keep)
            self._committer.committed(r + 1)
            published.settle(True)
            self._events.notify()  # round r is closed now, not committing
        except Exception as e:
            published.settle(False)  # before the roll back moves the weights
            log.exception("commit of round %d failed", r)
            self.open.closing = True  # admit no upload while going back
            self._intake.abort_direct()
            await self._intake.idle()
            await self.back.roll_back(f"the commit of round {r} failed ({e})", "commit_failed")
        finally:
            published.settle(False)  # cancelled: no-op once settled
            if self._committer.published is published and not published.durable:
                self._committer.serve(None)
            # Committed, it stays published until the next merge: a later download of it still
            # comes from memory (the file was written past the page cache, so reading it would
            # go to the disk), and from the file only once the weights move on.

    async def _settle_commit(self) -> bool:
        """Before a merge: wait for the previous round's background commit. False when it failed
        and the run went back meanwhile: the round being closed no longer exists."""
        rollbacks = self.back.count
        if self._commit_task is not None:
            await asyncio.gather(self._commit_task, return_exceptions=True)
            self._commit_task = None
        return self.back.count == rollbacks

    async def roll_back_to(self, version: int, who: str) -> dict[str, Any]:
        """An admin's roll back to kept `version` (`GoingBack.roll_back_to`)."""
        return await self.back.roll_back_to(version, who)

    def _privacy_meta(self) -> dict[str, str] | None:
        """The privacy record a new version carries (its checkpoint metadata), None without DP."""
        return self.privacy.metadata() if self.privacy is not None else None
