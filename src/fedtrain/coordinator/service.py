"""The coordinator's service: the one place where a run's side effects happen.

Routes (`app.py`) parse and authorize, then call this service; the service keeps the
in-memory round state, streams uploads through validation into a spool file and folds
them into the running weighted sum, closes rounds by asking `policy.decide_round`, runs
the outer step, and commits each round (checkpoint files first, then the database row).

`Coordinator` is put together from parts, a module each: `participants` (joining,
heartbeats, evictions, tokens), `live_config` (the shared config, changed at round
boundaries), `uploads` (receiving, checking and folding updates) and `rounds` (closing,
merging, committing and rolling back rounds; downloads), over `base` (the state they
share). This module holds the run's lifecycle (create it or resume it from the state
directory, start, stop) and its status.

Memory is a constant number of model copies whatever the number of participants: the
master weights and the outer optimizer state (`OuterOptimizer`) and one accumulator
(`RunningSum`); uploads wait on disk, never in RAM (`uploads.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
import signal
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from fedtrain.config import RunConfig, check_upload_limit, outer_defaults, parse_config
from fedtrain.config_changes import apply_change, change_notes, config_diff
from fedtrain.coordinator import policy
from fedtrain.coordinator.auth import Identity, Tokens
from fedtrain.coordinator.base import Live, Refused, log
from fedtrain.coordinator.broadcast import Broadcaster
from fedtrain.coordinator.checkpoints import CheckpointDir
from fedtrain.coordinator.global_eval import GlobalEvaluator
from fedtrain.coordinator.live_config import CONFIG_FILE_META, LiveConfigMixin
from fedtrain.coordinator.participants import ParticipantsMixin
from fedtrain.coordinator.publish import Published, WeightsGuard
from fedtrain.coordinator.receive import SpoolFiles, Staging
from fedtrain.coordinator.restore import load_version, newest_intact, restore_record
from fedtrain.coordinator.rounds import RoundsMixin
from fedtrain.coordinator.spool import RoundSpool
from fedtrain.coordinator.statelock import StateLock
from fedtrain.coordinator.store import Store
from fedtrain.coordinator.uploads import UploadsMixin
from fedtrain.errors import FedtrainError, StateError
from fedtrain.merge import OuterOptimizer, RunningSum, all_finite
from fedtrain.wire import EncodedBody, iter_file, read_tensors

__all__ = ["Coordinator", "Live", "Refused", "all_finite", "frozen_base_fingerprint", "initial_weights"]


def initial_weights(cfg: RunConfig, init_file: Path | None) -> dict[str, torch.Tensor]:
    """The run's version-0 weights: a safetensors file given at start, or the recipe from its seed."""
    if init_file is not None:
        try:
            return {k: v.float() if v.is_floating_point() else v for k, v in read_tensors(iter_file(init_file))}
        except (OSError, FedtrainError) as e:
            raise StateError(f"cannot read initial weights {init_file}: {e}") from None
    from fedtrain.recipes import build_model

    model = build_model(cfg.model, seed=cfg.seed)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def frozen_base_fingerprint(cfg: RunConfig, init_file: Path | None) -> str | None:
    """For LoRA runs of a recipe model: the hash of the frozen base every participant must share."""
    if init_file is not None or cfg.model.lora is None:
        return None
    from fedtrain.recipes import base_fingerprint, build_model

    return base_fingerprint(build_model(cfg.model, seed=cfg.seed))


class Coordinator(ParticipantsMixin, LiveConfigMixin, UploadsMixin, RoundsMixin):
    """A run's state and every operation on it. Create, `open()`, then `await start()`."""

    def __init__(
        self,
        state_dir: str | Path,
        config: RunConfig | None = None,
        tokens: Tokens | None = None,
        init_weights: Path | None = None,
        clock: Callable[[], float] = time.time,
        config_path: Path | None = None,
        lock: StateLock | None = None,
        apply_config: bool = False,
        recover: bool = False,
        fast_io: bool | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self._fast_io = fast_io  # the transport's fast paths (None: FEDTRAIN_FAST_IO decides)
        self.lock = lock  # the state dir's OS lock: taken by the caller early, else at open()
        self.config_path = config_path
        self.broadcast = Broadcaster()
        self.tokens = tokens or Tokens()
        self._given_config = config
        # On a resumed run the stored config wins over `config` (a restart with the command that
        # started the run must not undo live changes); `apply_config` applies it as a new version.
        self._apply_config = apply_config
        # A damaged newest checkpoint: resume from the newest intact kept version (`restore.py`).
        self._recover = recover
        self.config_file_diff: dict[str, list[Any]] = {}  # the given config against the stored one, not applied
        self._init_weights = init_weights
        self.clock = clock
        self._fold_lock = threading.Lock()
        self._folds = 0
        self._direct = None
        self._deferred_folds = set()
        self._fold_failure = None
        self._changed: asyncio.Event | None = None
        self._tick_task: asyncio.Task | None = None
        self._close_task: asyncio.Task | None = None
        self._commit_task: asyncio.Task | None = None  # the commit of the open round's predecessor
        self._published: Published | None = None
        self._weights = WeightsGuard()
        self._rollbacks = 0
        self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedtrain-prune")
        # Every download's bytes, counted by `model_stream`; not reported: the run's totals are
        # the sums of the participants' counters, which the store keeps across restarts (`status`).
        self.bytes_out = 0
        self.storage_full_since: float | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def open(self) -> None:
        """Load the run from the state directory, or create it; never loads a partial round.
        The directory is locked first: a second coordinator on it is refused before it touches
        anything (`statelock.py`)."""
        if self.lock is None or not self.lock.held:
            self.lock = StateLock.acquire(self.state_dir)
        try:
            self._open_locked()
        except BaseException:
            self.lock.release()
            raise

    def _open_locked(self) -> None:
        self.store = Store(self.state_dir / "run.db")
        self.ckpt = CheckpointDir(self.state_dir / "checkpoints", fast_io=self._fast_io)
        self.ckpt.remove_temp_files()
        self.spool = self.state_dir / "spool"
        shutil.rmtree(self.spool, ignore_errors=True)
        self.spool.mkdir()
        self._spool_files = SpoolFiles(self.spool)
        version = self.store.committed_version()
        if version is None:
            self._create()
        else:
            self._resume(version)
        self.committed_version = self.version
        self.spec = {n: (t.dtype, tuple(t.shape)) for n, t in self.outer.params.items()}
        self.acc = RunningSum(self.outer.params)
        self._staging = Staging()
        self.participants = {p.id: p for p in self.store.participants()}
        self.live: dict[str, Live] = {pid: Live() for pid in self.participants}
        now = self.clock()
        for p in self.participants.values():
            if p.state == policy.ACTIVE:
                p.last_seen = now  # a grace period to reconnect after a coordinator restart
        self.submitted: dict[str, int] = {}
        self.opened_at = now
        self.closing = False
        self.reason = "round opened"
        self._open_robustness()

    def _open_robustness(self) -> None:
        """State of the fault and security features: retained spool, late folds, deadlines, revocations."""
        self.round_spool = RoundSpool(self.spool)
        self.late: dict[str, int] = {}  # "pid@lateR" -> tokens, folded into the open round
        self._round_times: list[float] = []  # seconds after the round opened of each submission
        self._rejected: dict[str, str] = {}  # norm outliers of the round being merged
        self.submit_times: deque[list[float]] = deque(maxlen=100)
        for row in reversed(self.store.rounds(limit=self.config.deadline_window)):
            subs = self.store.submissions(row["round"])
            self.submit_times.append([max(0.0, s["received_at"] - row["opened_at"]) for s in subs])
        self.tokens.revoked.update(json.loads(self.store.get_meta("revoked_tokens") or "[]"))

    def _create(self) -> None:
        cfg = self._given_config or RunConfig()
        params = initial_weights(cfg, self._init_weights)
        self.config = cfg
        self.spec = {n: (t.dtype, tuple(t.shape)) for n, t in params.items()}
        check_upload_limit(cfg, self.update_bytes(cfg), source="run config")
        self.config_version = self.store.add_config_version(cfg.model_dump(mode="json"), author="start")
        self.latest_config_version = self.config_version
        if self.config_path is not None:
            self.store.set_meta(CONFIG_FILE_META, json.dumps(cfg.model_dump(mode="json")))
        self.outer = OuterOptimizer(params, cfg.outer.algorithm, outer_defaults(cfg.outer))
        digest = self._write_checkpoint(
            0, self.outer, EncodedBody(self.outer.params, self._model_meta(0), digest_algorithm=cfg.digest))
        with self.store.write() as db:
            self.store.set_meta("global_version", "0", db)
            self.store.set_meta("digest/0", digest, db)
            self.store.set_meta("created_at", str(time.time()), db)
            base = frozen_base_fingerprint(cfg, self._init_weights)
            if base is not None:
                self.store.set_meta("base_fingerprint", base, db)
        self.version = 0
        self.store.add_event(
            "run",
            f"run {cfg.name!r} created: {len(params)} tensors, {sum(t.numel() for t in params.values()):,} parameters",
        )

    def _resume(self, version: int) -> None:
        stored = self.store.config_for_round(version)
        if stored is None:
            raise StateError(f"{self.state_dir}: the database has rounds but no config; the state is damaged")
        self.config_version, data = stored
        cfg = parse_config(data, source=f"stored config of {self.state_dir}")
        outer, version = self._load_committed(version, cfg)
        self.spec = {n: (t.dtype, tuple(t.shape)) for n, t in outer.params.items()}
        if self._given_config is not None:
            cfg = self._reconcile_given_config(cfg, version)
        self.latest_config_version = max(self.config_version, self.store.latest_config()[0])  # type: ignore[index]
        self.config = cfg
        self.outer = outer
        self.version = version
        self._reconfigure_outer()
        dropped = self.store.discard_uncommitted(version)
        self.ckpt.prune(version, self.config.keep_checkpoints)
        self.store.add_event(
            "run", f"resumed at round {version} (last committed); {dropped} uncommitted submissions to be sent again"
        )

    def _load_committed(self, version: int, cfg: RunConfig) -> tuple[OuterOptimizer, int]:
        """The last committed version, loaded and verified. If its files are damaged on disk, a
        clear refusal naming the newest intact kept version, or with `recover` that version
        committed again as `version + 1` (recorded as an event). Returns the optimizer and
        the version the run resumes at."""
        try:
            return load_version(self.ckpt, self.store, version), version
        except StateError as e:
            damaged = e.message
        found = newest_intact(self.ckpt, self.store, below=version)
        if found is None:
            raise StateError(f"{damaged}; no older kept checkpoint verifies either: restore the state directory "
                             "from a backup")
        intact, outer = found
        self.outer = outer
        if not self._recover:
            raise StateError(f"{damaged}. The newest intact kept version is {intact}: restart with --recover to "
                             f"resume from it (rounds {intact}..{version - 1} are lost and trained again), or put "
                             "the damaged file back from a backup")
        reason = f"recovered from version {intact} at the restart: {damaged}"
        self._commit_restored(version, outer, reason, cfg)
        self.store.add_event("recover", f"{reason}; resumed at round {version + 1} with the weights of version "
                                        f"{intact} (--recover)")
        return outer, version + 1

    def _commit_restored(self, r: int, outer: OuterOptimizer, reason: str, cfg: RunConfig) -> None:
        """Close round r with no updates and commit `outer` (a kept version's) as version r + 1."""
        self.store.discard_uncommitted(r)
        meta = {"run": cfg.name, "algorithm": outer.algorithm, "version": str(r + 1)}
        body = EncodedBody(outer.params, meta, digest_algorithm=cfg.digest)
        record = restore_record(r, getattr(self, "opened_at", time.time()), reason, outer.algorithm)
        record["digest"] = self._write_checkpoint(r + 1, outer, body)
        self.store.commit_round(record, {})

    def kept_versions(self, ident: Identity) -> dict[str, Any]:
        """Admin: the committed versions whose checkpoint files are kept (a roll back's choices)."""
        self._require_admin(ident, "listing the kept versions")
        kept = [v for v in self.ckpt.versions() if v <= self.committed_version]
        return {"versions": sorted(kept, reverse=True), "committed_version": self.committed_version}

    async def roll_back_to(self, ident: Identity, version: int) -> dict[str, Any]:
        """Admin: put a kept version's weights and optimizer state back in force.

        The open round r closes with no updates (uploads sent for it are dropped; their
        senders find it closed and fetch the new model) and version r + 1 is committed with
        the kept version's state, durably, before this returns (`restore.py`)."""
        self._require_admin(ident, "rolling the run back")
        kept = self.kept_versions(ident)["versions"]
        if version not in kept:
            raise Refused(404, "version_not_kept", f"version {version} is not a kept checkpoint; kept: "
                                                   f"{', '.join(map(str, kept)) or 'none'}")
        if self.closing:
            raise Refused(409, "round_closing", f"round {self.version} is closing; try again in a moment")
        self.closing = True  # admit no upload while going back
        self._abort_direct()
        try:
            await self._settle_commit()
            while self._folds:
                await asyncio.sleep(0.01)
            r = self.version
            reason = f"rolled back to version {version} by {ident.role}"
            await asyncio.to_thread(self._roll_back_in_thread, r, version, reason)
        finally:
            self.closing = False
        self.version = self.committed_version = r + 1
        self.submitted = {}
        self._end_round_extras(committed=False)
        self.opened_at = self.clock()
        self._enter_round()
        self.reason = "round opened"
        self._event("rollback", f"{reason}: round {r} closed with no updates, version {r + 1} holds the weights "
                                f"of version {version}")
        self._notify()
        return {"version": r + 1, "restored": version}

    def _roll_back_in_thread(self, r: int, version: int, reason: str) -> None:
        outer = load_version(self.ckpt, self.store, version)
        with self._fold_lock:
            with self._weights.lock:
                self._weights.epoch += 1
                self.outer = outer
                self._published = None  # version r + 1 is served from its file
            self.acc.reset()
            self._reconfigure_outer()  # the config in force may name another algorithm than v's
        # Outside the fold lock, which the checkpoint writer takes itself; no fold runs (closing).
        self._commit_restored(r, self.outer, reason, self.config)

    def _reconcile_given_config(self, cfg: RunConfig, version: int) -> RunConfig:
        """A config given at the restart of a stored run: the stored run's config stays in force
        and the differences are kept in `config_file_diff` for the caller to show, unless
        `apply_config`, which validates the given one as a change and stores it as a new
        version with its true diff. Returns the config in force at `version`."""
        given = self._given_config
        assert given is not None
        latest = parse_config(self.store.latest_config()[1], source=f"stored config of {self.state_dir}")  # type: ignore[index]
        if given.model != latest.model:
            raise StateError(
                f"{self.state_dir} holds a run of a different model ({latest.model.model_dump()}); "
                "use a new --state-dir, or start without --config to resume the stored run"
            )
        diff = config_diff(latest.model_dump(mode="json"), given.model_dump(mode="json"))
        if self.config_path is not None and self.store.get_meta(CONFIG_FILE_META) is None:
            self.store.set_meta(CONFIG_FILE_META, json.dumps(given.model_dump(mode="json")))  # SIGHUP's base
        if not diff:
            return cfg
        where = str(self.config_path) if self.config_path is not None else "the given config"
        if not self._apply_config:
            self.config_file_diff = diff
            changes = ", ".join(f"{k}: {a} (stored) vs {b} (file)" for k, (a, b) in diff.items())
            self.store.add_event("config", f"restarted with {where}, which differs from the stored run; the stored "
                                           f"config stays in force (--apply-config applies the file): {changes}")
            return cfg
        new, diff = apply_change(latest, given.model_dump(mode="json"), source=where, update_bytes=self.update_bytes)
        self.config_version = self.store.add_config_version(
            new.model_dump(mode="json"), author="start --apply-config", diff=diff, effective_round=version
        )
        if self.config_path is not None:
            self.store.set_meta(CONFIG_FILE_META, json.dumps(given.model_dump(mode="json")))
        changes = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in diff.items())
        notes = "".join(f"; {n}" for n in change_notes(latest, new))
        self.store.add_event("config", f"config v{self.config_version} from {where} applied at the restart "
                                       f"(--apply-config), in force from round {version}: {changes}{notes}")
        return new

    async def start(self) -> None:
        self._changed = asyncio.Event()
        self._tick_task = asyncio.create_task(self._ticker())
        self._global_eval = GlobalEvaluator(self)  # does nothing unless the config names eval.global_data
        self._global_eval.start()
        if self.config_path is not None:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload_config_file)

    async def stop(self) -> None:
        try:
            await self._stop()
        finally:  # whatever went wrong on the way out, the state dir is free for the next one
            if self.lock is not None:
                self.lock.release()

    async def _stop(self) -> None:
        if self._commit_task is not None:  # a published round is committed before we go
            await asyncio.gather(self._commit_task, return_exceptions=True)
        for task in (self._tick_task, self._close_task, *self._deferred_folds):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # shutting down: nothing to report
                    await task
        self.broadcast.close_all()
        self._janitor.shutdown(wait=True)
        if getattr(self, "_global_eval", None) is not None:
            self._global_eval.stop()
        try:  # a participant's downloads since its row was last stored count too
            self.store.upsert_participants(list(self.participants.values()))
        except sqlite3.Error as e:
            log.warning("the participants' counters could not be stored at the stop: %s", e)
        self.store.close()

    # -- status ---------------------------------------------------------------------------------

    def rounds_total(self) -> int:
        """The rounds the run has in all (0: no end): the config's `rounds`, or, for a run that
        finished past it, the rounds it committed. A config in force with fewer rounds than
        were already committed (lowered live, or a restart with another --config) finishes the
        run where it stands; its total is then the committed count, not the lower figure, so
        that the open round never reads as past the end (`round 408/400`)."""
        return self.version if self.finished else self.config.rounds

    def status(self) -> dict[str, Any]:
        params = sum(math.prod(s) for _, s in self.spec.values())
        recent = self.store.rounds(limit=20)
        last_weights = {s["participant_id"]: s["weight"] for s in recent[0]["submissions"]} if recent else {}
        return {
            "run": self.config.name,
            "current_round": self.version,
            "rounds": self.rounds_total(),
            "rounds_configured": self.config.rounds,
            "finished": self.finished,
            "closing": self.closing,
            "reason": self.reason,
            "deadline_s": self.deadline()[0],
            "deadline_reason": self.deadline()[1],
            "algorithm": self.outer.algorithm,
            "config_version": self.config_version,
            "latest_config_version": self.latest_config_version,
            "parameters": params,
            "model_bytes": sum(t.numel() * t.element_size() for t in self.outer.params.values()),
            # The run's traffic: the sums of the participants' counters, which persist (a
            # download without a participant_id, such as `fedtrain export`, is not counted).
            "bytes_in": sum(p.bytes_up for p in self.participants.values()),
            "bytes_out": sum(p.bytes_down for p in self.participants.values()),
            "submitted": sorted(self.submitted),
            "participants": [
                {
                    "id": p.id,
                    "state": p.state,
                    "round": p.round,
                    "tokens": p.tokens,
                    "bytes_up": p.bytes_up,
                    "bytes_down": p.bytes_down,
                    "last_seen": p.last_seen,
                    "step": self.live.get(p.id, Live()).step,
                    "loss": self.live.get(p.id, Live()).loss,
                    "tokens_per_s": self.live.get(p.id, Live()).tokens_per_s,
                    "config_version": p.config_version,
                    "weight": last_weights.get(p.id),
                }
                for p in sorted(self.participants.values(), key=lambda p: p.id)
            ],
            "recent_rounds": recent,
        }
