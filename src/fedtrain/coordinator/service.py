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
import logging
import math
import re
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedtrain.config import RunConfig, outer_defaults, parse_config
from fedtrain.coordinator import policy
from fedtrain.coordinator.auth import Identity, Tokens
from fedtrain.coordinator.checkpoints import CheckpointDir
from fedtrain.coordinator.store import ParticipantRow, Store
from fedtrain.errors import FedtrainError, MergeError, StateError
from fedtrain.merge import OuterOptimizer, RunningSum, check_compatible, contribution_weights
from fedtrain.wire import DTYPE_TO_ST, BodyReader, TensorSpec, iter_file, read_tensors

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


class Coordinator:
    """A run's state and every operation on it. Create, `open()`, then `await start()`."""

    def __init__(
        self,
        state_dir: str | Path,
        config: RunConfig | None = None,
        tokens: Tokens | None = None,
        init_weights: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.tokens = tokens or Tokens()
        self._given_config = config
        self._init_weights = init_weights
        self.clock = clock
        self._fold_lock = threading.Lock()
        self._folds = 0
        self._changed: asyncio.Event | None = None
        self._tick_task: asyncio.Task | None = None
        self._close_task: asyncio.Task | None = None
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
        self.spec = {n: (t.dtype, tuple(t.shape)) for n, t in self.outer.params.items()}
        self.acc = RunningSum(self.outer.params)
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

    def _create(self) -> None:
        cfg = self._given_config or RunConfig()
        params = initial_weights(cfg, self._init_weights)
        self.config = cfg
        self.config_version = self.store.add_config_version(cfg.model_dump(mode="json"), author="start")
        self.outer = OuterOptimizer(params, cfg.outer.algorithm, outer_defaults(cfg.outer))
        digest = self._write_checkpoint(0)
        with self.store.write() as db:
            self.store.set_meta("global_version", "0", db)
            self.store.set_meta("digest/0", digest, db)
            self.store.set_meta("created_at", str(time.time()), db)
        self.version = 0
        self.store.add_event(
            "run",
            f"run {cfg.name!r} created: {len(params)} tensors, {sum(t.numel() for t in params.values()):,} parameters",
        )

    def _resume(self, version: int) -> None:
        stored = self.store.latest_config()
        if stored is None:
            raise StateError(f"{self.state_dir}: the database has rounds but no config; the state is damaged")
        self.config_version, data = stored
        cfg = parse_config(data, source=f"stored config of {self.state_dir}")
        given = self._given_config
        if given is not None and given != cfg:
            if given.model != cfg.model:
                raise StateError(
                    f"{self.state_dir} holds a run of a different model ({cfg.model.model_dump()}); "
                    "use a new --state-dir, or start without --config to resume the stored run"
                )
            cfg = given
            self.config_version = self.store.add_config_version(cfg.model_dump(mode="json"), author="start")
        self.config = cfg
        params = self.ckpt.load_global(version, self.store.get_meta(f"digest/{version}"))
        tensors, meta = self.ckpt.load_outer(version)
        try:
            self.outer = OuterOptimizer.restore(params, tensors, meta)
        except MergeError as e:
            raise StateError(f"outer optimizer state of version {version} cannot be restored: {e}") from None
        if self.outer.algorithm != cfg.outer.algorithm:
            self.outer = OuterOptimizer(params, cfg.outer.algorithm, outer_defaults(cfg.outer))
            self.store.add_event("config", f"outer algorithm is now {cfg.outer.algorithm} (fresh state)")
        self.version = version
        dropped = self.store.discard_uncommitted(version)
        self.ckpt.prune(version, self.config.keep_checkpoints)
        self.store.add_event(
            "run", f"resumed at round {version} (last committed); {dropped} uncommitted submissions to be sent again"
        )

    def _write_checkpoint(self, version: int) -> str:
        meta = {"run": self.config.name, "algorithm": self.outer.algorithm}
        return self.ckpt.write(
            version, self.outer.params, self.outer.state_tensors(), self.outer.state_metadata(), meta
        )

    async def start(self) -> None:
        self._changed = asyncio.Event()
        self._tick_task = asyncio.create_task(self._ticker())

    async def stop(self) -> None:
        for task in (self._tick_task, self._close_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # shutting down: nothing to report
                    await task
        self.store.close()

    # -- small helpers ------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return policy.run_finished(self.version, self.config)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    def _event(self, kind: str, message: str, pid: str | None = None) -> None:
        log.info("%s: %s", kind, message)
        self.store.add_event(kind, message, pid)

    def _participant(self, ident: Identity, pid: str) -> ParticipantRow:
        p = self.participants.get(pid)
        if p is None:
            raise Refused(404, "unknown_participant", f"participant {pid!r} is not part of this run; join first")
        if p.token_id != ident.token_id and not ident.is_admin:
            raise Refused(403, "forbidden", f"participant {pid!r} joined with a different token")
        return p

    def model_spec(self) -> dict[str, dict[str, Any]]:
        return {n: {"dtype": DTYPE_TO_ST[d], "shape": list(s)} for n, (d, s) in self.spec.items()}

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

    # -- uploads ----------------------------------------------------------------------------

    def _check_open(self, round_: int) -> None:
        if self.finished:
            raise Refused(
                409,
                "run_finished",
                f"the run finished after {self.version} rounds",
                {"current_round": self.version, "finished": True},
            )
        if round_ != self.version or self.closing:
            state = "closing" if round_ == self.version else ("closed" if round_ < self.version else "not open")
            raise Refused(
                409,
                "round_closed",
                f"round {round_} is {state}; the current round is {self.version}: "
                "download the current global model and continue",
                {"current_round": self.version},
            )

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
            self._check_open(round_)
            if pid in self.submitted:
                await _drain(chunks)
                return {"accepted": True, "duplicate": True, "round": round_}
            if self.config.outer.weighting == "tokens" and tokens <= 0:
                raise Refused(400, "invalid_tokens", "tokens must be a positive count of tokens processed this round")
            limit = int(self.config.max_upload_mb * 1_000_000)
            if length is None:
                raise Refused(411, "length_required", "uploads need a Content-Length header")
            if length > limit:
                raise Refused(413, "too_large", f"upload of {length:,} bytes exceeds max_upload_mb ({limit:,} bytes)")
        except Refused:
            await _drain(chunks)
            raise
        path = self.spool / f"{round_}-{pid}.safetensors"
        try:
            try:
                await self._receive(chunks, path, digest, length, limit)
            except BaseException:
                await _drain(chunks)
                raise
            self._check_open(round_)  # the round may have closed while the body streamed in
            if pid in self.submitted:
                return {"accepted": True, "duplicate": True, "round": round_}
            weight = float(tokens) if self.config.outer.weighting == "tokens" else 1.0
            self._folds += 1
            self.submitted[pid] = tokens  # reserved now, so that the round waits for this fold
            try:
                await asyncio.to_thread(self._fold, path, weight)
            except BaseException:
                self.submitted.pop(pid, None)
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
        self.store.add_submission(round_, pid, tokens, length, digest)
        self.store.upsert_participant(p)
        self._maybe_close()
        self._notify()
        return {"accepted": True, "duplicate": False, "round": round_}

    async def _receive(self, chunks: AsyncIterator[bytes], path: Path, digest: str, length: int, limit: int) -> None:
        reader = BodyReader(
            expected_digest=digest, max_bytes=limit, expected_length=length, on_header=self._check_header
        )
        with open(path, "wb") as f:
            async for chunk in chunks:
                f.write(chunk)
                for name, tensor in reader.feed(chunk):
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        raise Refused(422, "non_finite", f"tensor {name} contains NaN or Inf; the update was refused")
            reader.finish()

    def _check_header(self, specs: dict[str, TensorSpec], metadata: dict[str, str]) -> None:
        check_compatible(self.spec, {n: (s.dtype, s.shape) for n, s in specs.items()}, what="update")

    def _fold(self, path: Path, weight: float) -> None:
        with self._fold_lock:
            for name, tensor in read_tensors(iter_file(path)):
                self.acc.fold(name, tensor, weight)
            self.acc.finish_contribution(weight)

    # -- rounds -----------------------------------------------------------------------------

    def _views(self) -> list[policy.ParticipantView]:
        return [policy.ParticipantView(p.id, p.state, p.last_seen) for p in self.participants.values()]

    def decide(self) -> policy.Decision:
        rnd = policy.RoundView(self.version, self.opened_at, frozenset(self.submitted))
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
        r = self.version
        try:
            record = await asyncio.to_thread(self._merge_and_commit, r, reason)
        except Exception as e:
            log.exception("merge of round %d failed", r)
            self._event(
                "merge_failed",
                f"merge of round {r} failed ({e}); reloading the last committed round, uploads must be sent again",
            )
            await asyncio.to_thread(self._reload_committed)
            self.submitted = {}
            self.closing = False
            self._notify()
            return
        self.version = r + 1
        self.submitted = {}
        self.opened_at = self.clock()
        self.closing = False
        self.reason = "run finished" if self.finished else "round opened"
        self._event(
            "round", f"round {r} closed: {reason}; {record['n_submissions']} updates, merge {record['merge_s']:.2f}s"
        )
        if self.finished:
            self._event("finished", f"run finished after {self.version} rounds")
        self._notify()

    def _merge_and_commit(self, r: int, reason: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self._fold_lock:
            tokens = dict(self.submitted)
            weights = contribution_weights(tokens, self.config.outer.weighting)
            self.outer.step(self.acc.mean())
            digest = self._write_checkpoint(r + 1)
            record = {
                "round": r,
                "opened_at": self.opened_at,
                "closed_at": self.clock(),
                "close_reason": reason,
                "algorithm": self.outer.algorithm,
                "n_submissions": len(tokens),
                "tokens": sum(tokens.values()),
                "bytes_in": sum(s["bytes"] for s in self.store.submissions(r)),
                "merge_s": time.perf_counter() - t0,
                "digest": digest,
            }
            self.store.commit_round(record, weights)
            self.acc.reset()
        self.ckpt.prune(r + 1, self.config.keep_checkpoints)
        return record

    def _reload_committed(self) -> None:
        with self._fold_lock:
            v = self.version
            params = self.ckpt.load_global(v, self.store.get_meta(f"digest/{v}"))
            tensors, meta = self.ckpt.load_outer(v)
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
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._changed is None:
                break
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                break
        return self.round_info(round_, pid)

    # -- downloads and views -------------------------------------------------------------------

    def model_file(self, version: int | None, pid: str | None = None) -> tuple[Path, int, str]:
        v = self.version if version is None else version
        path = self.ckpt.global_path(v)
        digest = self.store.get_meta(f"digest/{v}")
        if v > self.version or digest is None or not path.is_file():
            kept = [x for x in self.ckpt.versions() if x <= self.version]
            raise Refused(404, "version_not_kept", f"global model version {v} is not available (kept: {kept})")
        size = path.stat().st_size
        self.bytes_out += size
        if pid is not None and pid in self.participants:
            self.participants[pid].bytes_down += size
        return path, v, digest

    def status(self) -> dict[str, Any]:
        params = sum(math.prod(s) for _, s in self.spec.values())
        return {
            "run": self.config.name,
            "current_round": self.version,
            "rounds": self.config.rounds,
            "finished": self.finished,
            "closing": self.closing,
            "reason": self.reason,
            "algorithm": self.outer.algorithm,
            "config_version": self.config_version,
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
                }
                for p in sorted(self.participants.values(), key=lambda p: p.id)
            ],
            "recent_rounds": self.store.rounds(limit=20),
        }


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    """Read what is left of a request body, so that the client receives our answer."""
    try:
        async for _ in chunks:
            pass
    except Exception:  # noqa: BLE001 - a client gone away is not our error to report
        pass
