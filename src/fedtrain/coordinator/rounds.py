"""Rounds: closing the open round, merging and committing it, or going back; downloads.

A part (mixin) of `Coordinator` (`service.py`). Whether to close is the decision of
`policy.decide_round`, asked after each upload and departure and on a periodic tick.
Closing waits for the folds in flight, aggregates the round, takes the outer step and
commits: checkpoint files first (fsync'd), then the database row. A failed merge or
commit goes back to the last committed round, and the uploads since must be sent again.
The merged weights are checked before anything is published (`OuterOptimizer.step` raises
`NonFiniteStep`): a merge that is not finite is not committed; the update that moves it the
most (`policy.largest_influence`) is refused for that round, an event names its participant,
and the round goes back for the others to send theirs again. (Updates are refused one by one
before that, as they come in, for values no outer step can take: see `uploads.py`; this is
for what only their sum, or the optimizer's own settings, make of them.)
The new weights are served from memory at once (`model_stream`, `publish.py`) and the
next round opens; the commit starts at once beside it. By default (commit first) no
download completes before it is done; with `publish_first` downloads are not held back.
The checkpoint goes to the disk with O_DIRECT (`checkpoints.py`), which costs the downloads
beside it almost no CPU, so `publish_first` too starts its commit at once rather than after
the downloads: waiting for them gains nothing with rounds apart, and with rounds back to
back it delays the next merge.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fedtrain import faults
from fedtrain.coordinator import policy, storage
from fedtrain.coordinator.auth import Identity
from fedtrain.coordinator.base import CoordinatorBase, Refused
from fedtrain.coordinator.publish import ModelStream, Published
from fedtrain.coordinator.storage import storage_full
from fedtrain.errors import MergeError
from fedtrain.merge import OuterOptimizer, contribution_weights
from fedtrain.merge.outer import NonFiniteStep
from fedtrain.merge.robust import norm_outliers
from fedtrain.wire import EncodedBody

if TYPE_CHECKING:
    from fedtrain.coordinator.uploads import RoundUpdates

log = logging.getLogger("fedtrain.coordinator")


class PoisonedMerge(MergeError):
    """A round's merge was not finite; `key` names the update refused for it (`largest_influence`)."""

    def __init__(self, message: str, key: str, round_: int, why: str) -> None:
        super().__init__(message)
        self.key, self.round, self.why = key, round_, why


class RoundsMixin(CoordinatorBase):
    """The coordinator's round closing, commits, roll-backs, long-polls and downloads."""

    if TYPE_CHECKING:  # defined by the uploads part

        @property
        def _updates(self) -> RoundUpdates: ...

        def fold_waiting(self, fold_weights: dict[str, float]) -> None: ...

        def _clear_updates(self) -> None: ...

        def _give_back_freed(self) -> None: ...

    def _views(self) -> list[policy.ParticipantView]:
        return [policy.ParticipantView(p.id, p.state, p.last_seen) for p in self.participants.values()]

    def deadline(self) -> tuple[float, str]:
        """The open round's deadline in seconds after it opened, and why (fixed or adaptive)."""
        return policy.adaptive_deadline(self.submit_times, self.config)

    def decide(self) -> policy.Decision:
        rnd = policy.RoundView(self.version, self.opened_at, frozenset(self.submitted), self.deadline()[0])
        return policy.decide_round(rnd, self._views(), self.clock(), self.config)

    def _maybe_close(self) -> None:
        if self.closing or self.finished:
            return
        decision = self.decide()
        self.reason = decision.reason
        if decision.action == "close":
            self.closing = True
            self._abort_direct()
            self._close_task = asyncio.create_task(self._close_round(decision.reason))

    async def _close_round(self, reason: str) -> None:
        while self._folds:
            await asyncio.sleep(0.01)
        if not await self._settle_commit():
            self.closing = False
            self._notify()
            return
        r = self.version
        try:
            record = await asyncio.to_thread(self._merge, r, reason, self.config.publish_first)
        except PoisonedMerge as e:
            pid = e.key.split("@")[0]
            self._updates.barred[(e.round, pid)] = (
                f"the update of {pid} for round {e.round} was refused: the merge it took part in was not finite "
                f"({e.message}), and {e.why}")
            self._event("refuse", self._updates.barred[(e.round, pid)], pid)
            await self._roll_back(f"the merge of round {r} was not finite", "merge_refused")
            return
        except Exception as e:
            log.exception("merge of round %d failed", r)
            await self._roll_back(f"merge of round {r} failed ({e})", "merge_failed")
            return
        for key, why in self._rejected.items():
            self._event("reject", f"the update of {key} for round {r} was left out: {why}", key.split("@")[0])
        for key, why in self._updates_capped.items():
            self._event("cap", f"the update of {key} for round {r}: {why}", key.split("@")[0])
        self.version = r + 1
        published = self._published
        assert published is not None  # every merge publishes its model
        # The commit writes this optimizer and the served body, whatever config the next round
        # brings in (`_enter_round` may replace `self.outer` before the commit is done).
        self._commit_task = asyncio.create_task(self._commit_in_background(r, record, published, self.outer))
        self.submitted = {}
        self._end_round_extras(committed=True)
        self.opened_at = self.clock()
        self.closing = False
        self._enter_round()
        self.reason = "run finished" if self.finished else "round opened"
        self._event(
            "round", f"round {r} closed: {reason}; {record['n_submissions']} updates, merge {record['merge_s']:.2f}s"
        )
        if self.finished:
            self._event("finished", f"run finished after {self.version} rounds")
        self._notify()

    async def _roll_back(self, why: str, kind: str) -> None:
        """Back to the last committed round: its weights and optimizer state, no uploads."""
        self._event(kind, f"{why}; reloading the last committed round {self.committed_version}, "
                          "uploads must be sent again")
        self.version = self.committed_version
        self._published = None
        self._rollbacks += 1
        await self._reload_when_there_is_room()
        self.submitted = {}
        self._end_round_extras(committed=False)
        self.closing = False
        self._notify()

    async def _reload_when_there_is_room(self) -> None:
        """Reload the last committed round; while the disk is full (its database writes fail),
        wait and try again, answering uploads 507 meanwhile (`storage_full_since`), so the run
        goes on by itself once there is room. Any other failure is raised as before."""
        delay = 0.5
        while True:
            try:
                await asyncio.to_thread(self._reload_committed)
            except Exception as e:
                if not storage_full(e):
                    raise
                if self.storage_full_since is None:
                    self.storage_full_since = self.clock()
                    log.warning("going back to round %d waits for room on the disk: %s", self.version, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, storage.RETRY_AFTER_S)
                continue
            if self.storage_full_since is not None:
                self._event("storage", f"room on the disk again after {self.clock() - self.storage_full_since:.0f}s: "
                                       f"back at round {self.version}, uploads are taken again")
                self.storage_full_since = None
            return

    def _end_round_extras(self, committed: bool) -> None:
        """A round closed (or its merge failed): late folds and retained updates go; times count."""
        if committed:
            self.submit_times.append(self._round_times)
            oldest = self.version - self.config.max_staleness  # a late upload may still come for it
            for barred in [k for k in self._updates.barred if k[0] < oldest]:
                del self._updates.barred[barred]
        self._round_times = []
        self.late = {}
        self.round_spool.clear()
        self._clear_updates()
        self._fold_failure = None

    _updates_capped: Mapping[str, str] = {}  # the capped shares of the round last merged, with reasons

    def _spooled_shares(self) -> tuple[dict[str, str], dict[str, float]]:
        """Before the retained updates are aggregated: the norm outliers left out, and the
        shares of those kept. For the weighted mean the kept ones' weights become their capped
        shares (`policy.cap_shares`) in `round_spool`, which folds them with those."""
        outer, entries = self.config.outer, self.round_spool.entries
        rejected = norm_outliers({k: e.norm for k, e in entries.items()}, outer.outlier_factor)
        kept = {k: e.weight for k, e in entries.items() if k not in rejected}
        if not kept:
            return rejected, {}
        if outer.aggregator != "mean":
            return rejected, {k: 1.0 / len(kept) for k in kept}
        shares, self._updates_capped = policy.cap_shares(kept, outer.max_share)
        for k, share in shares.items():
            entries[k] = dataclasses.replace(entries[k], weight=share)
        return rejected, shares

    def _merge(self, r: int, reason: str, publish_first: bool) -> dict[str, Any]:
        """Aggregate the round, take the outer step and make the new weights downloadable at
        once (their digest, and a body over them); held back until committed unless `publish_first`."""
        t0 = time.perf_counter()
        with self._fold_lock:
            if self._fold_failure is not None:
                raise MergeError(self._fold_failure)
            tokens = dict(self.submitted)
            faults.hit("merge.before_step", round=r)
            dtypes = {n: d for n, (d, _) in self.spec.items()}
            self._updates_capped = {}
            if self.round_spool.entries:  # kept on disk until now: robust aggregators, outliers, a low cap
                _, shares = self._spooled_shares()
                self._rejected = self.round_spool.aggregate_into(self.acc, self.config.outer, dtypes)
            else:
                self._rejected = {}
                shares, fold, self._updates_capped = policy.closing_weights(self._updates.entries,
                                                                            self.config.outer.max_share)
                self.fold_waiting(fold)
            weights = self._round_weights(tokens, self._rejected)
            with self._weights.lock:
                self._weights.epoch += 1
                try:  # the sum is finite by construction (`RunningSum`): only the result is checked
                    self.outer.step(*self.acc.scaled(), finite=True)
                except NonFiniteStep as e:
                    raise self._poisoned(r, e, shares) from None
            self.acc.reset()
        record = {
            "round": r,
            "opened_at": self.opened_at,
            "closed_at": self.clock(),
            "close_reason": reason,
            "algorithm": self.outer.algorithm,
            "n_submissions": len(tokens),
            "tokens": sum(tokens.values()),
            "bytes_in": sum(s["bytes"] for s in self.store.submissions(r)),
            "weights": weights,
        }
        body = EncodedBody(self.outer.params, self._model_meta(r + 1), digest_algorithm=self.config.digest)
        self._published = Published(r + 1, body.digest(), body, self._weights.epoch, hold=not publish_first)
        record["merge_s"] = time.perf_counter() - t0
        return record

    def _commit(self, r: int, record: dict[str, Any], published: Published, outer: OuterOptimizer) -> None:
        """Make round r durable: checkpoint files (fsync'd), then the database row. The model
        file holds the served body's bytes, which are not hashed again (a restart checks the
        file against the served digest); the optimizer state is the one that made them."""
        t0 = time.perf_counter()
        weights = record.pop("weights")
        record["digest"] = self._write_checkpoint(r + 1, outer, published.body)
        faults.hit("checkpoint.after_global_write", round=r)
        record["commit_s"] = time.perf_counter() - t0
        faults.hit("commit.before_db", round=r)
        self.store.commit_round(record, weights)
        faults.hit("commit.after_db", round=r)
        self.committed_version = r + 1
        # Unlinking old files (freeing their blocks, and pages a download cached) takes time: off the round trip.
        self._janitor.submit(self.ckpt.prune, r + 1, self.config.keep_checkpoints, orphans=False)

    async def _commit_in_background(self, r: int, record: dict[str, Any], published: Published,
                                    outer: OuterOptimizer) -> None:
        """Commit round r while round r + 1 runs; if that fails, go back to the last committed
        round at once (what was served of r + 1 is dropped, and held downloads of it are cut short)."""
        try:
            await asyncio.to_thread(self._commit, r, record, published, outer)
            published.settle(True)
            self._notify()  # round r is closed now, not committing
        except Exception as e:
            published.settle(False)  # before the roll back moves the weights
            log.exception("commit of round %d failed", r)
            self.closing = True  # admit no upload while going back
            self._abort_direct()
            while self._folds:
                await asyncio.sleep(0.01)
            await self._roll_back(f"the commit of round {r} failed ({e})", "commit_failed")
        finally:
            published.settle(False)  # cancelled: no-op once settled
            if self._published is published and not published.durable:
                self._published = None
            # Committed, it stays published until the next merge: a later download of it still
            # comes from memory (the file was written past the page cache, so reading it would
            # go to the disk), and from the file only once the weights move on.

    async def _settle_commit(self) -> bool:
        """Before a merge: wait for the previous round's background commit. False when it failed
        and the run went back meanwhile: the round being closed no longer exists."""
        rollbacks = self._rollbacks
        if self._commit_task is not None:
            await asyncio.gather(self._commit_task, return_exceptions=True)
            self._commit_task = None
        return self._rollbacks == rollbacks

    def _model_meta(self, version: int) -> dict[str, str]:
        return {"run": self.config.name, "algorithm": self.outer.algorithm, "version": str(version)}

    def _poisoned(self, r: int, e: NonFiniteStep, shares: Mapping[str, float]) -> PoisonedMerge:
        """The refusal for a merge that is not finite: of the update that moves it the most."""
        largest = {k: c.max_abs for k, c in self._updates.entries.items()}
        key, why = policy.largest_influence(shares, largest)
        round_ = int(key.split("@late")[1]) if "@late" in key else r
        return PoisonedMerge(e.message, key, round_, why)

    def _round_weights(self, tokens: dict[str, int], rejected: dict[str, str]) -> dict[str, float]:
        """Recorded weights: normalised over the kept updates (uniform for median/trimmed mean),
        capped at outer.max_share for the weighted mean (`policy.cap_shares`), 0 if left out."""
        kept = {k: v for k, v in tokens.items() if k not in rejected}
        outer = self.config.outer
        mode = outer.weighting if outer.aggregator == "mean" else "uniform"
        weights = contribution_weights(kept, mode) if kept else {}
        if weights and outer.aggregator == "mean":
            weights = policy.cap_shares(weights, outer.max_share)[0]
        weights.update({k: 0.0 for k in tokens if k in rejected})
        return weights

    def _reload_committed(self) -> None:
        with self._fold_lock:
            v = self.version
            params = self.ckpt.load_global(v, self.store.get_meta(f"digest/{v}"))
            tensors, meta = self.ckpt.load_outer(v)
            with self._weights.lock:
                self._weights.epoch += 1
                self.outer = OuterOptimizer.restore(params, tensors, meta)
            self.acc.reset()
            self.store.discard_uncommitted(v)
            self.ckpt.prune(v, self.config.keep_checkpoints)

    def tick(self) -> None:
        """Periodic duties: fail silent participants, close rounds whose deadline passed."""
        now = self.clock()
        changed = False
        for pid, why in policy.stale_participants(self._views(), now, self.config):
            p = self.participants[pid]
            p.state = policy.FAILED
            self.store.upsert_participant(p)
            self._abort_direct(pid)
            self._event("fail", f"{pid} failed: {why}", pid)
            changed = True
        self._maybe_close()
        if changed:
            self._notify()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                self.tick()
            except Exception:
                log.exception("coordinator tick failed")

    def round_info(self, round_: int, pid: str | None = None) -> dict[str, Any]:
        if round_ < self.version:  # merged; "committing" until its checkpoint and record are durable
            state = "closed" if round_ < self.committed_version else "committing"
        elif round_ == self.version:
            state = "finished" if self.finished else ("closing" if self.closing else "open")
        else:
            state = "not_open"
        active = sum(1 for p in self.participants.values() if p.state == policy.ACTIVE)
        return {
            "round": round_,
            "state": state,
            "current_round": self.version,
            "finished": self.finished,
            "submitted": (pid in self.submitted) if pid and round_ == self.version else None,
            "n_submitted": len(self.submitted) if round_ == self.version else None,
            "n_active": active,
            "reason": self.reason,
            "config_version": self.config_version,
        }

    async def wait_round(self, ident: Identity, pid: str | None, round_: int, wait_s: float) -> dict[str, Any]:
        """Long-poll: answer as soon as round `round_` is closed (committed), or after `wait_s`.
        A participant (`pid`) is answered as soon as the round is merged ("committing"): its
        next step, the download of the new model, completes once the round is committed."""
        if pid is not None:
            self._participant(ident, pid)
        if round_ > self.version:
            raise Refused(
                409,
                "round_not_open",
                f"round {round_} has not opened; the current round is {self.version}",
                {"current_round": self.version},
            )

        def pending() -> bool:
            if round_ == self.version:
                return not self.finished
            return pid is None and self.committed_version <= round_ < self.version  # merged, committing

        deadline = time.monotonic() + max(0.0, min(wait_s, 60.0))
        while pending():
            if round_ == self.version and pid is not None and not self.closing and pid not in self.submitted:
                break  # its upload is missing (lost, or dropped by a restart): answer now so it resends
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._changed is None:
                break
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                break
        return self.round_info(round_, pid)

    # -- downloads ------------------------------------------------------------------------------

    def model_stream(self, version: int | None, pid: str | None = None) -> ModelStream:
        """A download of global version `version` (default: the newest): from memory while it
        is the published version (being committed, or committed and not yet stepped past),
        else from its committed file."""
        v = self.version if version is None else version
        path = self.ckpt.global_path(v)
        published = self._published if self._published is not None and self._published.version == v else None
        if published is not None:
            stream = ModelStream(v, published.digest, published.body.content_length, path, self.ckpt, published,
                                 self._weights)
        else:
            digest = self.store.get_meta(f"digest/{v}")
            try:
                if v > self.committed_version or digest is None:
                    raise FileNotFoundError(path)
                stream = ModelStream(v, digest, path.stat().st_size, path, self.ckpt)
            except FileNotFoundError:  # never kept, or pruned a moment ago
                kept = [x for x in self.ckpt.versions() if x <= self.committed_version]
                raise Refused(404, "version_not_kept",
                              f"global model version {v} is not available (kept: {kept})") from None
        self.bytes_out += stream.size
        if pid is not None and pid in self.participants:
            self.participants[pid].bytes_down += stream.size
        return stream
