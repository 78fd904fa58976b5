"""The coordinator's service: the one place where a run's side effects happen.

Routes (`app.py`) parse and authorize, then call this service; the service keeps the
in-memory round state, streams uploads through validation into a spool file and folds
them into the running weighted sum, closes rounds by asking `policy.decide_round`, runs
the outer step, and commits each round (checkpoint files first, then the database row).

Memory is a constant number of model copies whatever the number of participants: the
master weights and the outer optimizer state (`OuterOptimizer`) and one accumulator
(`RunningSum`). An upload is verified while it streams in (header against the model,
every tensor finite, the body digest) and written to a spool file on disk, never held in
RAM; once complete and verified it is folded into the sum and the spool file is deleted.
A bad upload therefore never touches the sum: the run's state is left exactly as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import shutil
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedtrain import faults
from fedtrain.config import RunConfig, apply_change, outer_defaults, parse_config
from fedtrain.coordinator import policy
from fedtrain.coordinator.auth import Identity, Tokens, fingerprint
from fedtrain.coordinator.broadcast import Broadcaster
from fedtrain.coordinator.checkpoints import CheckpointDir
from fedtrain.coordinator.global_eval import GlobalEvaluator
from fedtrain.coordinator.publish import ModelStream, Published, WeightsGuard
from fedtrain.coordinator.spool import RoundSpool, needs_spool
from fedtrain.coordinator.store import ParticipantRow, Store
from fedtrain.coordinator.uploads import Staging, drain, largest_tensor_bytes, receive_to_spool
from fedtrain.errors import ConfigError, FedtrainError, MergeError, StateError
from fedtrain.merge import OuterOptimizer, RunningSum, all_finite, check_compatible, contribution_weights
from fedtrain.merge.robust import clip_scale, sum_of_squares
from fedtrain.wire import DTYPE_TO_ST, EncodedBody, TensorSpec, iter_file, read_tensors
from fedtrain.wire.compress import expected_specs, scheme_of

log = logging.getLogger("fedtrain.coordinator")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class Refused(FedtrainError):
    """A request the coordinator refuses, with the HTTP status and code to answer with."""

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, details=details)
        self.status = status
        self.code = code


@dataclass
class Live:
    """What a participant last told us; kept in memory only."""

    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    round: int = 0
    config_version: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


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


class Coordinator:
    """A run's state and every operation on it. Create, `open()`, then `await start()`."""

    def __init__(
        self,
        state_dir: str | Path,
        config: RunConfig | None = None,
        tokens: Tokens | None = None,
        init_weights: Path | None = None,
        clock: Callable[[], float] = time.time,
        config_path: Path | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.config_path = config_path
        self.broadcast = Broadcaster()
        self.tokens = tokens or Tokens()
        self._given_config = config
        self._init_weights = init_weights
        self.clock = clock
        self._fold_lock = threading.Lock()
        self._folds = 0
        self._changed: asyncio.Event | None = None
        self._tick_task: asyncio.Task | None = None
        self._close_task: asyncio.Task | None = None
        self._commit_task: asyncio.Task | None = None  # publish_first: the open round's predecessor
        self._published: Published | None = None
        self._weights = WeightsGuard()
        self._rollbacks = 0
        self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedtrain-prune")
        self.bytes_in = 0
        self.bytes_out = 0

    # -- lifecycle --------------------------------------------------------------------------

    def open(self) -> None:
        """Load the run from the state directory, or create it; never loads a partial round."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(self.state_dir / "run.db")
        self.ckpt = CheckpointDir(self.state_dir / "checkpoints")
        self.ckpt.remove_temp_files()
        self.spool = self.state_dir / "spool"
        shutil.rmtree(self.spool, ignore_errors=True)
        self.spool.mkdir()
        version = self.store.committed_version()
        if version is None:
            self._create()
        else:
            self._resume(version)
        self.committed_version = self.version
        self.spec = {n: (t.dtype, tuple(t.shape)) for n, t in self.outer.params.items()}
        self.acc = RunningSum(self.outer.params)
        self._staging = Staging(largest_tensor_bytes(self.spec))
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

    def _end_round_extras(self, committed: bool) -> None:
        """A round closed (or its merge failed): late folds and retained updates go; times count."""
        if committed:
            self.submit_times.append(self._round_times)
        self._round_times = []
        self.late = {}
        self.round_spool.clear()

    def _create(self) -> None:
        cfg = self._given_config or RunConfig()
        params = initial_weights(cfg, self._init_weights)
        self.config = cfg
        self.config_version = self.store.add_config_version(cfg.model_dump(mode="json"), author="start")
        self.latest_config_version = self.config_version
        self.outer = OuterOptimizer(params, cfg.outer.algorithm, outer_defaults(cfg.outer))
        digest = self._write_checkpoint(0)
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
        latest = parse_config(self.store.latest_config()[1], source=f"stored config of {self.state_dir}")  # type: ignore[index]
        given = self._given_config
        if given is not None and given != latest:
            if given.model != cfg.model:
                raise StateError(
                    f"{self.state_dir} holds a run of a different model ({cfg.model.model_dump()}); "
                    "use a new --state-dir, or start without --config to resume the stored run"
                )
            cfg = given
            self.config_version = self.store.add_config_version(
                cfg.model_dump(mode="json"), author="start", effective_round=version
            )
        self.latest_config_version = max(self.config_version, self.store.latest_config()[0])  # type: ignore[index]
        self.config = cfg
        params = self.ckpt.load_global(version, self.store.get_meta(f"digest/{version}"))
        tensors, meta = self.ckpt.load_outer(version)
        try:
            self.outer = OuterOptimizer.restore(params, tensors, meta)
        except MergeError as e:
            raise StateError(f"outer optimizer state of version {version} cannot be restored: {e}") from None
        self.version = version
        self._reconfigure_outer()
        dropped = self.store.discard_uncommitted(version)
        self.ckpt.prune(version, self.config.keep_checkpoints)
        self.store.add_event(
            "run", f"resumed at round {version} (last committed); {dropped} uncommitted submissions to be sent again"
        )

    def _write_checkpoint(self, version: int) -> str:
        return self.ckpt.write(
            version, self.outer.params, self.outer.state_tensors(), self.outer.state_metadata(),
            self._model_meta(version), self.config.digest,
        )

    async def start(self) -> None:
        self._changed = asyncio.Event()
        self._tick_task = asyncio.create_task(self._ticker())
        self._global_eval = GlobalEvaluator(self)  # does nothing unless the config names eval.global_data
        self._global_eval.start()
        if self.config_path is not None:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload_config_file)

    async def stop(self) -> None:
        if self._commit_task is not None:  # a published round is committed before we go
            await asyncio.gather(self._commit_task, return_exceptions=True)
        for task in (self._tick_task, self._close_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # shutting down: nothing to report
                    await task
        self.broadcast.close_all()
        self._janitor.shutdown(wait=True)
        if getattr(self, "_global_eval", None) is not None:
            self._global_eval.stop()
        self.store.close()

    # -- small helpers ------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return policy.run_finished(self.version, self.config)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()
            self.broadcast.publish("status", None)

    def _event(self, kind: str, message: str, pid: str | None = None) -> None:
        log.info("%s: %s", kind, message)
        self.store.add_event(kind, message, pid)
        if self._changed is not None:
            self.broadcast.publish("event", {"ts": time.time(), "kind": kind, "participant_id": pid,
                                             "message": message})

    def _participant(self, ident: Identity, pid: str) -> ParticipantRow:
        p = self.participants.get(pid)
        if p is None:
            raise Refused(404, "unknown_participant", f"participant {pid!r} is not part of this run; join first")
        if p.token_id != ident.token_id and not ident.is_admin:
            raise Refused(403, "forbidden", f"participant {pid!r} joined with a different token")
        if p.state == policy.EVICTED and not ident.is_admin:
            raise Refused(403, "evicted", f"participant {pid!r} was evicted from this run by an admin")
        return p

    def evict(self, ident: Identity, pid: str) -> dict[str, Any]:
        """Admin: remove a participant from the run; it may not rejoin under that name."""
        self._require_admin(ident, "evicting a participant")
        p = self._participant(ident, pid)
        p.state = policy.EVICTED
        self.store.upsert_participant(p)
        self._event("evict", f"{pid} evicted by an admin", pid)
        self._maybe_close()
        self._notify()
        return {"evicted": pid}

    def token_view(self, ident: Identity) -> dict[str, Any]:
        """Admin: the participant tokens by fingerprint, whether revoked, who joined with each."""
        self._require_admin(ident, "listing tokens")
        admin_id = fingerprint(self.tokens.admin) if self.tokens.admin else None
        ids = {fingerprint(t) for t in self.tokens.participant} | {p.token_id for p in self.participants.values()}
        ids |= self.tokens.revoked
        ids.discard(admin_id)  # type: ignore[arg-type]
        return {
            "tokens": [
                {
                    "token_id": t,
                    "revoked": t in self.tokens.revoked,
                    "participants": sorted(p.id for p in self.participants.values() if p.token_id == t),
                }
                for t in sorted(ids)
            ]
        }

    def revoke_token(self, ident: Identity, token_id: str | None, participant_id: str | None) -> dict[str, Any]:
        """Admin: refuse a participant token from now on (kept across restarts); its participants are evicted."""
        self._require_admin(ident, "revoking a token")
        if (token_id is None) == (participant_id is None):
            raise Refused(400, "invalid_request", "give exactly one of token_id or participant_id")
        if participant_id is not None:
            token_id = self._participant(ident, participant_id).token_id
        assert token_id is not None
        if self.tokens.admin and token_id == fingerprint(self.tokens.admin):
            raise Refused(400, "admin_token", "the admin token cannot be revoked; restart with another --admin-token")
        if token_id not in {t["token_id"] for t in self.token_view(ident)["tokens"]}:
            raise Refused(404, "unknown_token", f"no participant token has the fingerprint {token_id!r}")
        self.tokens.revoked.add(token_id)
        self.store.set_meta("revoked_tokens", json.dumps(sorted(self.tokens.revoked)))
        evicted = []
        for p in self.participants.values():
            if p.token_id == token_id and p.state != policy.EVICTED:
                p.state = policy.EVICTED
                self.store.upsert_participant(p)
                evicted.append(p.id)
        self._event("revoke", f"token {token_id} revoked by an admin; evicted: {', '.join(evicted) or 'none'}")
        self._maybe_close()
        self._notify()
        return {"revoked": token_id, "evicted": evicted}

    def model_spec(self) -> dict[str, dict[str, Any]]:
        return {n: {"dtype": DTYPE_TO_ST[d], "shape": list(s)} for n, (d, s) in self.spec.items()}

    # -- config: shared, versioned, changed live at round boundaries ---------------------------

    def _reconfigure_outer(self) -> None:
        """Make the outer optimizer match the config in force: a new algorithm starts with fresh
        state; new hyperparameters keep the state where it still fits."""
        want_alg, want_hp = self.config.outer.algorithm, outer_defaults(self.config.outer)
        if self.outer.algorithm == want_alg and self.outer.hp == want_hp:
            return
        params = self.outer.params
        if self.outer.algorithm != want_alg:
            self.outer = OuterOptimizer(params, want_alg, want_hp)
            self._event("config", f"outer optimizer switched to {want_alg} with fresh state")
            return
        meta = {**self.outer.state_metadata(), "hp": json.dumps(want_hp)}
        try:
            self.outer = OuterOptimizer.restore(params, self.outer.state_tensors(), meta)
        except MergeError:
            self.outer = OuterOptimizer(params, want_alg, want_hp)
            self._event("config", f"outer optimizer state reset: the new {want_alg} settings need other state")

    def _enter_round(self) -> None:
        """At a round boundary: put in force the newest config version meant for this round."""
        found = self.store.config_for_round(self.version)
        if found is None or found[0] == self.config_version:
            return
        version, data = found
        self.config_version, self.config = version, parse_config(data, source=f"config v{version}")
        with self._fold_lock:
            self._reconfigure_outer()
        self._event("config", f"config v{version} in force from round {self.version}")
        self.broadcast.publish("config", self.config_view(None))

    def config_view(self, round_: int | None) -> dict[str, Any]:
        """The config in force at `round_` (default: now), with the newest accepted version."""
        if round_ is None or round_ == self.version:
            version, cfg = self.config_version, self.config.model_dump(mode="json")
        else:
            found = self.store.config_for_round(round_)
            if found is None:
                raise Refused(404, "no_config", f"no config was in force at round {round_}")
            version, cfg = found
        return {"version": version, "config": cfg, "round": self.version if round_ is None else round_,
                "latest_version": self.latest_config_version}

    def _require_admin(self, ident: Identity, what: str) -> None:
        if not ident.is_admin:
            raise Refused(403, "admin_only", f"{what} needs the admin token")

    def validate_config(self, ident: Identity, patch: Any) -> dict[str, Any]:
        """Dry run of a change: valid or not, the reason, and the diff it would make."""
        self._require_admin(ident, "validating a config change")
        latest = parse_config(self.store.latest_config()[1])  # type: ignore[index]
        try:
            _, diff = apply_change(latest, patch)
        except ConfigError as e:
            return {"valid": False, "error": e.message, "diff": {}}
        return {"valid": True, "error": None, "diff": diff}

    def change_config(self, ident: Identity, patch: Any, *, author: str | None = None) -> dict[str, Any]:
        """Accept a live change (validated against the newest version) as a new version that
        takes effect at the next round boundary — at once if no one has started this round."""
        if author is None:
            self._require_admin(ident, "changing the config")
        latest = parse_config(self.store.latest_config()[1])  # type: ignore[index]
        new, diff = apply_change(latest, patch)
        if not diff:
            return {"version": self.latest_config_version, "changed": False, "diff": {},
                    "effective_round": self.version}
        idle = not self.submitted and not any(p.state == policy.ACTIVE for p in self.participants.values())
        effective = self.version if idle else self.version + 1
        version = self.store.add_config_version(new.model_dump(mode="json"), author=author or ident.role, diff=diff,
                                                effective_round=effective)
        self.latest_config_version = version
        changes = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in diff.items())
        self._event("config", f"config v{version} accepted from {author or ident.role}, in force from round "
                              f"{effective}: {changes}")
        self.broadcast.publish("config_change", {"version": version, "effective_round": effective, "diff": diff})
        if effective == self.version:
            self._enter_round()
            self._notify()
        return {"version": version, "changed": True, "diff": diff, "effective_round": effective}

    def reload_config_file(self) -> None:
        """SIGHUP: apply the config file again as a change; an invalid file changes nothing."""
        from fedtrain.config import load_config

        assert self.config_path is not None
        try:
            new = load_config(self.config_path)
            self.change_config(Identity("admin", "file"), new.model_dump(mode="json"), author="file")
        except ConfigError as e:
            self._event("config", f"reload of {self.config_path} refused: {e.message}")

    # -- participants ------------------------------------------------------------------------

    def join(self, ident: Identity, name: str | None, info: dict[str, Any]) -> dict[str, Any]:
        if name is None:
            name = f"p-{len(self.participants) + 1}-{int(self.clock() * 1000) % 100000:05d}"
        if not _NAME_RE.match(name):
            raise Refused(
                400, "invalid_name", f"participant name {name!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
        now = self.clock()
        p = self.participants.get(name)
        if p is not None and p.token_id != ident.token_id and not ident.is_admin:
            raise Refused(409, "name_taken", f"participant name {name!r} is taken by a holder of another token")
        if p is not None and p.state == policy.EVICTED:
            raise Refused(403, "evicted", f"participant {name!r} was evicted from this run by an admin")
        base = self.store.get_meta("base_fingerprint")
        if base is not None and info.get("base") is not None and info["base"] != base:
            # LoRA adapters trained on another base would be merged as if they fit this one.
            raise Refused(
                409, "base_mismatch",
                f"participant {name!r} has a different frozen base model than the run "
                f"(fingerprint {str(info['base'])[:12]}, the run's {base[:12]}): load the run's base weights",
            )
        if p is None:
            p = ParticipantRow(name, name, ident.token_id, policy.ACTIVE, now, now, self.version, 0, 0, 0, info)
            self._event("join", f"{name} joined at round {self.version}", name)
        else:
            was = p.state
            p.state, p.last_seen, p.info = policy.ACTIVE, now, info or p.info
            self._event("join", f"{name} rejoined at round {self.version} (was {was})", name)
        self.participants[name] = p
        self.live.setdefault(name, Live())
        self.store.upsert_participant(p)
        self._notify()
        return {
            "participant_id": name,
            "run": self.config.name,
            "config": self.config.model_dump(mode="json"),
            "config_version": self.config_version,
            "current_round": self.version,
            "finished": self.finished,
            "model": self.model_spec(),
        }

    def heartbeat(self, ident: Identity, pid: str, stats: dict[str, Any]) -> dict[str, Any]:
        p = self._participant(ident, pid)
        p.last_seen = self.clock()
        if p.state == policy.FAILED:
            p.state = policy.ACTIVE
            self._event("recover", f"{pid} is back after a heartbeat timeout", pid)
            self._notify()
        live = self.live.setdefault(pid, Live())
        live.step = int(stats.get("step", live.step))
        live.loss = stats.get("loss", live.loss)
        live.tokens_per_s = stats.get("tokens_per_s", live.tokens_per_s)
        live.round = int(stats.get("round", live.round))
        if stats.get("config_version") is not None:  # versions only grow: a late heartbeat cannot undo an ack
            p.config_version = max(int(stats["config_version"]), p.config_version or 0)
        self.store.upsert_participant(p)
        return {
            "current_round": self.version,
            "finished": self.finished,
            "state": p.state,
            "config_version": self.config_version,
        }

    def leave(self, ident: Identity, pid: str) -> dict[str, Any]:
        p = self._participant(ident, pid)
        p.state = policy.LEFT
        self.store.upsert_participant(p)
        self._event("leave", f"{pid} left", pid)
        self._maybe_close()
        self._notify()
        return {"left": True}

    def add_metrics(
        self, ident: Identity, pid: str, round_: int | None, step: int | None, values: dict[str, float]
    ) -> None:
        self._participant(ident, pid)
        self.store.add_metrics(pid, round_, step, values)
        now = time.time()  # the dashboard's charts follow this event (rows shaped like GET /v1/metrics)
        self.broadcast.publish("metrics", [{"ts": now, "participant_id": pid, "round": round_, "step": step,
                                            "name": k, "value": v} for k, v in values.items()])

    # -- uploads ----------------------------------------------------------------------------

    def _check_open(self, round_: int) -> policy.Admission:
        """Admit an upload for `round_` into the open round (accept or late), or refuse with 409."""
        admission = policy.admit_upload(round_, self.version, self.closing, self.finished, self.config)
        if admission.action != "refuse":
            return admission
        if admission.code == "run_finished":
            raise Refused(409, "run_finished", admission.reason, {"current_round": self.version, "finished": True})
        raise Refused(
            409,
            "round_closed",
            f"{admission.reason}: download the current global model and continue",
            {"current_round": self.version},
        )

    def _upload_key(self, pid: str, round_: int, admission: policy.Admission) -> str:
        return pid if admission.action == "accept" else f"{pid}@late{round_}"

    def _is_duplicate(self, pid: str, round_: int, admission: policy.Admission) -> bool:
        """Sent before: into the open round, as a late fold, or (late) already part of round_ when it closed."""
        key = self._upload_key(pid, round_, admission)
        if key in self.submitted or key in self.late:
            return True
        return admission.action == "late" and any(s["participant_id"] == pid for s in self.store.submissions(round_))

    async def receive_update(
        self,
        ident: Identity,
        pid: str,
        round_: int,
        tokens: int,
        digest: str,
        length: int | None,
        chunks: AsyncIterator[bytes],
    ) -> dict[str, Any]:
        """Verify, spool and fold one participant's pseudo-gradient for `round_`."""
        p = self._participant(ident, pid)
        try:
            admission = self._check_open(round_)
            if self._is_duplicate(pid, round_, admission):
                await drain(chunks)
                return {"accepted": True, "duplicate": True, "round": round_}
            if self.config.outer.weighting == "tokens" and tokens <= 0:
                raise Refused(400, "invalid_tokens", "tokens must be a positive count of tokens processed this round")
            limit = int(self.config.max_upload_mb * 1_000_000)
            if length is None:
                raise Refused(411, "length_required", "uploads need a Content-Length header")
            if length > limit:
                raise Refused(413, "too_large", f"upload of {length:,} bytes exceeds max_upload_mb ({limit:,} bytes)")
        except Refused:
            await drain(chunks)
            raise
        path = self.spool / f"{round_}-{pid}.safetensors"
        try:
            try:
                await receive_to_spool(chunks, path, digest=digest, length=length, limit=limit,
                                       on_header=self._check_header, who=pid, round_=round_)
            except BaseException:
                await drain(chunks)
                raise
            faults.hit("upload.received", who=pid, round=round_)
            await asyncio.to_thread(self.check_values, path)
            norm = await asyncio.to_thread(self._norm, path)
            admission = self._check_open(round_)  # the round may have closed while the body streamed in
            key = self._upload_key(pid, round_, admission)
            if self._is_duplicate(pid, round_, admission):
                return {"accepted": True, "duplicate": True, "round": round_}
            weight = float(tokens) if self.config.outer.weighting == "tokens" else 1.0
            weight *= self.config.staleness_discount**admission.staleness
            self._folds += 1
            reserved = self.submitted if admission.action == "accept" else self.late
            reserved[key] = tokens  # reserved now, so that the round waits for this fold
            try:
                if needs_spool(self.config.outer):
                    self.round_spool.keep(key, path, self.version, weight, norm)
                else:
                    scale = clip_scale(norm, self.config.outer.clip_norm)
                    await asyncio.to_thread(self._fold, path, weight, scale)
            except BaseException:
                reserved.pop(key, None)
                raise
            finally:
                self._folds -= 1
        finally:
            path.unlink(missing_ok=True)
        self.bytes_in += length
        p.bytes_up += length
        p.tokens += tokens
        p.round = round_
        p.last_seen = self.clock()
        if admission.action == "late":
            self._event("late", f"{pid}'s update for round {round_}: {admission.reason}", pid)
        else:
            self._round_times.append(max(0.0, self.clock() - self.opened_at))
            self.store.add_submission(round_, pid, tokens, length, digest)
        self.store.upsert_participant(p)
        self._maybe_close()
        self._notify()
        late = {"folded_into": self.version, "staleness": admission.staleness} if admission.action == "late" else {}
        return {"accepted": True, "duplicate": False, "round": round_, **late}

    def _check_header(self, specs: dict[str, TensorSpec], metadata: dict[str, str]) -> None:
        scheme, block = scheme_of(metadata)  # compressed deltas carry their scheme in the header
        check_compatible(expected_specs(self.spec, scheme, block), {n: (s.dtype, s.shape) for n, s in specs.items()},
                         what="update")

    def _norm(self, path: Path) -> float:
        """The L2 norm of a verified upload when a rule needs it (clip_norm, outlier_factor), else 0."""
        outer = self.config.outer
        if outer.clip_norm is None and outer.outlier_factor is None:
            return 0.0
        with self._fold_lock:
            return math.sqrt(sum(sum_of_squares(t) for _, t in self.spooled(path)))

    def _fold(self, path: Path, weight: float, scale: float = 1.0) -> None:
        """Fold a verified spool file; `scale` < 1 clips the update's norm (its weight counts in full)."""
        with self._fold_lock:
            for name, tensor in self.spooled(path):
                self.acc.fold(name, tensor, weight * scale)
            self.acc.finish_contribution(weight)

    def spooled(self, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """The decoded tensors of a verified spool file, one at a time, read into the staging
        buffer (the caller holds the fold lock; each tensor is valid until the next)."""
        return self._staging.decoded(path, {n: d for n, (d, _) in self.spec.items()})

    def check_values(self, path: Path) -> None:
        """Refuse a spooled upload with a NaN or Inf anywhere (one tensor in memory at a time,
        under the fold lock so concurrent uploads do not multiply the memory)."""
        with self._fold_lock:
            for name, tensor in self.spooled(path):
                if not all_finite(tensor):
                    raise Refused(422, "non_finite", f"tensor {name} contains NaN or Inf; the update was refused")

    # -- rounds -----------------------------------------------------------------------------

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
            self._close_task = asyncio.create_task(self._close_round(decision.reason))

    async def _close_round(self, reason: str) -> None:
        while self._folds:
            await asyncio.sleep(0.01)
        if not await self._settle_commit():
            self.closing = False
            self._notify()
            return
        r = self.version
        publish_first = self.config.publish_first
        try:
            record = await asyncio.to_thread(self._merge, r, reason, publish_first)
            if not publish_first:
                await asyncio.to_thread(self._commit, r, record)
        except Exception as e:
            log.exception("merge of round %d failed", r)
            await self._roll_back(f"merge of round {r} failed ({e})", "merge_failed")
            return
        for key, why in self._rejected.items():
            self._event("reject", f"the update of {key} for round {r} was left out: {why}", key.split("@")[0])
        self.version = r + 1
        if publish_first:
            self._commit_task = asyncio.create_task(self._commit_in_background(r, record))
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
        await asyncio.to_thread(self._reload_committed)
        self.submitted = {}
        self._end_round_extras(committed=False)
        self.closing = False
        self._notify()

    def _merge(self, r: int, reason: str, publish_first: bool) -> dict[str, Any]:
        """Aggregate the round and take the outer step; with `publish_first` also make the new
        weights downloadable at once (their digest, and a body over them)."""
        t0 = time.perf_counter()
        with self._fold_lock:
            tokens = dict(self.submitted)
            faults.hit("merge.before_step", round=r)
            dtypes = {n: d for n, (d, _) in self.spec.items()}
            self._rejected = self.round_spool.aggregate_into(self.acc, self.config.outer, dtypes)
            weights = self._round_weights(tokens, self._rejected)
            with self._weights.lock:
                self._weights.epoch += 1
                self.outer.step(self.acc.mean())
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
            "digest_algorithm": self.config.digest,
        }
        if publish_first:
            body = EncodedBody(self.outer.params, self._model_meta(r + 1), digest_algorithm=self.config.digest)
            self._published = Published(r + 1, body.digest(), body, self._weights.epoch)
        record["merge_s"] = time.perf_counter() - t0
        return record

    def _commit(self, r: int, record: dict[str, Any]) -> None:
        """Make round r durable: checkpoint files (fsync'd), then the database row."""
        t0 = time.perf_counter()
        weights, algorithm = record.pop("weights"), record.pop("digest_algorithm")
        record["digest"] = self.ckpt.write(r + 1, self.outer.params, self.outer.state_tensors(),
                                           self.outer.state_metadata(), self._model_meta(r + 1), algorithm)
        faults.hit("checkpoint.after_global_write", round=r)
        record["commit_s"] = time.perf_counter() - t0
        faults.hit("commit.before_db", round=r)
        self.store.commit_round(record, weights)
        faults.hit("commit.after_db", round=r)
        self.committed_version = r + 1
        # Unlinking the old files (freeing their page cache) takes ~0.1 s per GB: off the round trip.
        self._janitor.submit(self.ckpt.prune, r + 1, self.config.keep_checkpoints, orphans=False)

    async def _commit_in_background(self, r: int, record: dict[str, Any]) -> None:
        """publish_first: commit round r while round r + 1 runs; if that fails, go back to the
        last committed round at once (what was served of r + 1 is dropped)."""
        published = self._published
        try:
            await asyncio.to_thread(self._commit, r, record)
            if published is not None and record["digest"] != published.digest:  # same bytes by construction
                raise StateError(f"round {r}'s checkpoint digest differs from the model served from memory")
        except Exception as e:
            log.exception("commit of round %d failed", r)
            self.closing = True  # admit no upload while going back
            while self._folds:
                await asyncio.sleep(0.01)
            await self._roll_back(f"the commit of round {r} failed ({e})", "commit_failed")
        finally:
            if self._published is published:
                self._published = None

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

    def _round_weights(self, tokens: dict[str, int], rejected: dict[str, str]) -> dict[str, float]:
        """Recorded weights: normalised over the kept updates (uniform for median/trimmed mean), 0 if left out."""
        kept = {k: v for k, v in tokens.items() if k not in rejected}
        mode = self.config.outer.weighting if self.config.outer.aggregator == "mean" else "uniform"
        weights = contribution_weights(kept, mode) if kept else {}
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
        if round_ < self.version:
            state = "closed"
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
        """Long-poll: answer as soon as round `round_` is no longer open, or after `wait_s`."""
        if pid is not None:
            self._participant(ident, pid)
        if round_ > self.version:
            raise Refused(
                409,
                "round_not_open",
                f"round {round_} has not opened; the current round is {self.version}",
                {"current_round": self.version},
            )
        deadline = time.monotonic() + max(0.0, min(wait_s, 60.0))
        while round_ == self.version and not self.finished:
            if pid is not None and not self.closing and pid not in self.submitted:
                break  # its upload is missing (lost, or dropped by a restart): answer now so it resends
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._changed is None:
                break
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                break
        return self.round_info(round_, pid)

    # -- downloads and views -------------------------------------------------------------------

    def model_stream(self, version: int | None, pid: str | None = None) -> ModelStream:
        """A download of global version `version` (default: the newest): from its committed
        file, or from memory while a `publish_first` round's checkpoint is being written."""
        v = self.version if version is None else version
        path = self.ckpt.global_path(v)
        published = self._published if self._published is not None and self._published.version == v else None
        if published is not None:
            stream = ModelStream(v, published.digest, published.body.content_length, path, published, self._weights)
        else:
            digest = self.store.get_meta(f"digest/{v}")
            if v > self.committed_version or digest is None or not path.is_file():
                kept = [x for x in self.ckpt.versions() if x <= self.committed_version]
                raise Refused(404, "version_not_kept", f"global model version {v} is not available (kept: {kept})")
            stream = ModelStream(v, digest, path.stat().st_size, path)
        self.bytes_out += stream.size
        if pid is not None and pid in self.participants:
            self.participants[pid].bytes_down += stream.size
        return stream

    def status(self) -> dict[str, Any]:
        params = sum(math.prod(s) for _, s in self.spec.values())
        recent = self.store.rounds(limit=20)
        last_weights = {s["participant_id"]: s["weight"] for s in recent[0]["submissions"]} if recent else {}
        return {
            "run": self.config.name,
            "current_round": self.version,
            "rounds": self.config.rounds,
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
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
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


