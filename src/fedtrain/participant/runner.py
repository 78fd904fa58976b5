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

The sync itself lives in `_sync_round`, a plain function of the snapshot, so that a
background worker can run it later while training goes on (overlapped sync).

A participant acts only as itself: the client keeps the participant key of its join
answer and presents it on every call. With `key_file` the key is also kept on disk (mode
600), so that a participant restarted with the same file rejoins as itself at once; without
it, a restarted participant takes its name back once the old process has failed by
heartbeat timeout (the client waits for that).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedtrain import faults
from fedtrain.config import RunConfig
from fedtrain.errors import (
    CoordinatorError,
    CoordinatorUnavailable,
    MergeError,
    ModelMismatchError,
    RoundClosedError,
)
from fedtrain.merge import check_compatible
from fedtrain.participant.client import CoordinatorClient, RetryPolicy, Timeouts
from fedtrain.participant.outage import OutagePolicy, OutageState, is_transient, next_attempt, short_retries
from fedtrain.participant.overlap import OverlappedSync
from fedtrain.wire import ST_TO_DTYPE, EncodedBody, TensorSpec
from fedtrain.wire.compress import ErrorFeedback, compress

log = logging.getLogger("fedtrain.participant")

EvalFn = Callable[[nn.Module], "float | dict[str, float]"]
ConfigCallback = Callable[[RunConfig, RunConfig, dict[str, list[Any]]], None]


def sync_set(model: nn.Module) -> dict[str, nn.Parameter]:
    """The tensors that travel: the model's trainable parameters, by name."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


class Participant:
    """A context manager around a training loop that syncs it with a coordinator."""

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
        self._snapshot_valid = True  # the snapshot holds θ_round (not Δ, not a half-downloaded model)
        self._snapshot_is_delta = False
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
        self.bytes_up = 0
        self.bytes_down = 0
        self.sync_seconds = 0.0
        self.history: list[dict[str, Any]] = []
        self._params = sync_set(model)
        self._snapshot: dict[str, torch.Tensor] = {}
        self._round_steps = 0
        self._round_tokens = 0
        self._round_losses: list[float] = []
        self._last_loss: float | None = None
        self._rate = _Rate()
        self._stop = threading.Event()
        self._heart: threading.Thread | None = None
        self._listener: threading.Thread | None = None
        self.config_version = 0
        self.latest_config_version = 0
        self.events: list[tuple[str, Any]] = []
        self._callbacks: list[ConfigCallback] = []
        self._feedback = ErrorFeedback()
        self._overlap = OverlappedSync(self)

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Participant:
        name = self.name
        saved = _read_key_file(self.key_file) if self.key_file is not None else None
        if saved is not None and name in (None, saved[0]):  # rejoin as itself, under the name it had
            name = saved[0]
            self.client.remember_key(*saved)
        joined = self.client.join(name, self.info)
        self.participant_id = joined["participant_id"]
        key = self.client.participant_key(self.participant_id)
        if self.key_file is not None and key is not None and saved != (self.participant_id, key):
            _write_key_file(self.key_file, self.participant_id, key)
        self.config = RunConfig.model_validate(joined["config"])
        self.config_version = self.latest_config_version = int(joined["config_version"])
        self.round = int(joined["current_round"])
        self._check_model(joined["model"])
        self._snapshot = {n: torch.empty(tuple(p.shape), dtype=p.dtype) for n, p in self._params.items()}
        self._load_global()
        self.finished = bool(joined["finished"])
        self._heart = threading.Thread(target=self._heartbeats, name="fedtrain-heartbeat", daemon=True)
        self._heart.start()
        self._listener = threading.Thread(target=self._listen, name="fedtrain-events", daemon=True)
        self._listener.start()
        log.info("joined as %s at round %d (H=%d)", self.participant_id, self.round, self.sync_every)
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self._overlap.close()  # the last overlapped round lands before we leave
        self._stop.set()
        if self._heart is not None:
            self._heart.join(timeout=5)
        if isinstance(exc[1], faults.InjectedCrash):  # a crashed process says no goodbye
            self.client.close()
            return
        try:
            self.client.retry = RetryPolicy(max_elapsed_s=2.0)
            self.client.leave(self.participant_id)
        except CoordinatorError as e:
            log.info("could not say goodbye to the coordinator: %s", e.message)
        self.client.close()

    @property
    def sync_every(self) -> int:
        return self.config.train.sync_every

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
        self.steps += 1
        self.tokens += tokens
        self._round_steps += 1
        self._round_tokens += tokens
        self._rate.add(tokens)
        if loss is not None:
            self._last_loss = float(loss)
            self._round_losses.append(float(loss))
        if self._overlap.pending:
            self._overlap.poll()
            if self.finished:
                return True
        if self._round_steps >= self.sync_every and time.monotonic() >= self._outage.next_at:
            if self.config.train.overlap:
                self._overlap.start()
                return True
            if self._overlap.pending:  # overlap was switched off: land the pending round first
                self._overlap.finish()
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
        self._round_steps = 0
        self._round_tokens = 0
        self._round_losses = []

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
            with short_retries(self.client, self.outage_policy.attempt_s):
                self.client.report(self.participant_id, values, round_=r, step=self.steps)
        except CoordinatorError as e:
            log.warning("could not report metrics of round %d: %s", r, e.message)
        if reset:  # (an overlapped sync reset the counts when it sent the update)
            self._reset_round()
        try:
            with short_retries(self.client, self.outage_policy.attempt_s):
                self._apply_config()
        except CoordinatorError as e:
            if not is_transient(e):
                raise
            log.warning("could not fetch the config of round %d (%s); keeping the current one", self.round, e.message)

    # -- riding out an outage ----------------------------------------------------------------------

    def _attempt_sync(self, r: int) -> bool:
        """One sync attempt; on a transient failure restore the snapshot, schedule the next attempt
        and return False (or raise CoordinatorUnavailable once the outage budget is spent)."""
        try:
            with short_retries(self.client, self.outage_policy.attempt_s):
                self._sync_round(r)
        except CoordinatorError as e:
            if not is_transient(e):
                raise
            self._restore_snapshot()
            self._outage_failed(r, e)
            return False
        if self._outage.active:
            seconds = time.monotonic() - (self._outage.since or time.monotonic())
            self.outages.append({"round": r, "seconds": round(seconds, 2), "attempts": self._outage.attempts + 1})
            log.warning("the coordinator is back after %.0fs; synced round %d", seconds, r)
        self._outage = OutageState()
        return True

    def _coordinator_back(self) -> bool:
        """During an outage: a cheap probe before spending an eval and an upload on an attempt."""
        try:
            with short_retries(self.client, min(2.0, self.outage_policy.attempt_s)):
                self.client.health()
        except CoordinatorError as e:
            self._outage_failed(self.round, e)
            return False
        return True

    def _outage_failed(self, r: int, error: CoordinatorError) -> None:
        now = time.monotonic()
        self._outage.last_error = error.message
        decision = next_attempt(self._outage, now, self.outage_policy, self._outage_budget_s)
        if decision.action == "give_up":
            raise CoordinatorUnavailable(decision.reason, status=0, code="unavailable")
        if self._outage.since is None:
            self._outage.since = now
        self._outage.attempts += 1
        self._outage.next_at = now + decision.delay_s
        log.warning("round %d: %s", r, decision.reason)

    def _restore_snapshot(self) -> None:
        """Put θ_round back into the snapshot after a failed upload (Δ + θ_local = θ_round, to rounding)."""
        if not self._snapshot_is_delta:
            return
        with torch.no_grad():
            for name, p in self._params.items():
                self._snapshot[name].add_(p.detach().to("cpu", self._snapshot[name].dtype))
        self._snapshot_is_delta = False

    def _apply_config(self) -> None:
        """At a round boundary: take the config in force for the round we now start."""
        if self.finished:
            return
        view = self.client.get_config(round_=self.round)
        if int(view["version"]) == self.config_version:
            return
        old, new = self.config, RunConfig.model_validate(view["config"])
        from fedtrain.config_changes import config_diff

        diff = config_diff(old.model_dump(mode="json"), new.model_dump(mode="json"))
        self.config, self.config_version = new, int(view["version"])
        self.latest_config_version = max(self.latest_config_version, self.config_version)
        if "train.lr" in diff and self.inner_optimizer is not None:
            for group in self.inner_optimizer.param_groups:
                group["lr"] = new.train.lr
        log.info("config v%d in force from round %d: %s", self.config_version, self.round,
                 ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items()))
        for callback in self._callbacks:
            callback(old, new, diff)
        try:  # acknowledge at once the version we now run
            self.client.heartbeat(self.participant_id, step=self.steps, round=self.round,
                                  config_version=self.config_version)
        except CoordinatorError as e:
            log.debug("config acknowledgement failed: %s", e.message)

    # -- the sync, step by step ----------------------------------------------------------------

    def _sync_round(self, r: int) -> None:
        if self._snapshot_valid:  # else a download was cut short: round r is over, fetch the model again
            with torch.no_grad():
                for name, p in self._params.items():
                    self._snapshot[name].sub_(p.detach().to("cpu", self._snapshot[name].dtype))
            self._snapshot_is_delta = True
            body = self._encode_delta()
            uploaded = self._upload(r, body)
            give_up_at = time.monotonic() + self.config.round_timeout_s + self._outage_budget_s
            while uploaded:
                info = self._wait_round(r)
                if info["state"] != "open" and info["state"] != "closing":
                    break
                if info.get("submitted") is False and info["state"] == "open":
                    log.warning("the coordinator has no upload of ours for round %d (restarted?); sending again", r)
                    uploaded = self._upload(r, body)
                if time.monotonic() > give_up_at:  # nothing hangs forever, not even a round without quorum
                    raise CoordinatorUnavailable(
                        f"round {r} has not closed {self.config.round_timeout_s:g}s after its deadline: "
                        f"{info.get('reason', 'no reason given')}",
                        status=0,
                        code="unavailable",
                    )
        self._snapshot_is_delta = False
        self._snapshot_valid = False  # the download writes into the snapshot
        faults.hit("participant.download", who=self.name or self.participant_id, round=r)
        self._load_global()
        self._snapshot_valid = True

    def _wait_round(self, r: int) -> dict[str, Any]:
        """Long-poll round r. A coordinator that went back past r (it restarted, or a round it had
        served under publish_first failed to commit) answers round_not_open: r is gone, and the
        caller takes the coordinator's current model."""
        try:
            return self.client.wait_round(r, self.participant_id, wait_s=25.0)
        except CoordinatorError as e:
            if e.code != "round_not_open":
                raise
            log.warning("round %d is gone (%s); taking the coordinator's current model", r, e.message)
            return {"round": r, "state": "gone"}

    def _encode_delta(self) -> EncodedBody:
        """Δ (held in the snapshot buffers) as a body, compressed as the run config says."""
        t = self.config.train
        if t.compression == "none":
            return EncodedBody(self._snapshot, digest_algorithm=self.config.digest)
        if t.error_feedback:
            tensors, meta = self._feedback.compress(self._snapshot, t.compression, t.compression_block)
        else:
            tensors, meta = compress(self._snapshot, t.compression, t.compression_block)
        return EncodedBody(tensors, meta, digest_algorithm=self.config.digest)

    def _upload(self, r: int, body: EncodedBody) -> bool:
        if faults.hit("participant.upload", who=self.name or self.participant_id, round=r) == "drop":
            log.warning("fault injected: the upload of round %d is lost on the way", r)
            return True
        try:
            self.client.upload(r, self.participant_id, body, tokens=max(1, self._round_tokens))
        except RoundClosedError as e:
            log.warning("round %d closed before our upload (%s); moving on to the current model", r, e.message)
            return False
        self.bytes_up += body.content_length
        return True

    def _load_global(self) -> None:
        version, _ = self.client.download(
            pid=self.participant_id, allocate=self._allocate, on_header=self._check_header
        )
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(self._snapshot[name])
        self.bytes_down += sum(t.numel() * t.element_size() for t in self._snapshot.values())
        self.round = version
        self.finished = self.config.rounds > 0 and version >= self.config.rounds

    def _allocate(self, spec: TensorSpec) -> torch.Tensor:
        return self._snapshot[spec.name]

    def _check_header(self, specs: dict[str, TensorSpec], metadata: dict[str, str]) -> None:
        self._check_model({n: {"dtype": s.dtype, "shape": list(s.shape)} for n, s in specs.items()})

    def _check_model(self, spec: dict[str, dict[str, Any]]) -> None:
        def dtype(d: Any) -> torch.dtype:
            return d if isinstance(d, torch.dtype) else ST_TO_DTYPE[d]

        run = {n: (dtype(s["dtype"]), tuple(s["shape"])) for n, s in spec.items()}
        ours = {n: (p.dtype, tuple(p.shape)) for n, p in self._params.items()}
        try:
            check_compatible(run, ours, what="your model")
        except MergeError as e:
            raise ModelMismatchError(f"{e.message} (the run's model is the reference)", details=e.details) from None

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

    # -- heartbeats ---------------------------------------------------------------------------

    def _heartbeats(self) -> None:
        client = self.client.clone(retry=RetryPolicy(max_elapsed_s=1.0))
        try:
            while not self._stop.wait(self.config.heartbeat_interval_s):
                try:
                    client.heartbeat(
                        self.participant_id,
                        step=self.steps,
                        round=self.round,
                        loss=self._last_loss,
                        tokens_per_s=self._rate.per_second(),
                        config_version=self.config_version,
                    )
                except CoordinatorError as e:
                    log.debug("heartbeat failed: %s", e.message)
        finally:
            client.close()


    def _listen(self) -> None:
        """Follow the coordinator's event stream: learn of config changes as they are made
        (they are applied at the next round boundary) and keep recent run events."""
        client = self.client.clone(retry=RetryPolicy(max_elapsed_s=1.0))
        backoff = 0.5
        try:
            while not self._stop.is_set():
                try:
                    for kind, data in client.events(stop=self._stop.is_set):
                        backoff = 0.5
                        if kind == "config_change":
                            self.latest_config_version = max(self.latest_config_version, int(data["version"]))
                        if kind in ("config_change", "event"):
                            self.events = [*self.events[-99:], (kind, data)]
                except Exception as e:  # noqa: BLE001 - the stream is a convenience: log, back off, reconnect
                    log.debug("event stream interrupted: %s", e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
        finally:
            client.close()


def _read_key_file(path: Path) -> tuple[str, str] | None:
    """(participant id, participant key) kept in `path`, or None when there is none to use."""
    try:
        data = json.loads(path.read_text())
        pid, key = data["participant_id"], data["participant_key"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the participant key file %s: %s", path, e)
        return None
    return (pid, key) if isinstance(pid, str) and isinstance(key, str) else None


def _write_key_file(path: Path, pid: str, key: str) -> None:
    """Keep `key` in `path`, readable by its owner only (mkstemp's mode 600), replaced whole."""
    from fedtrain.participant.checkpoint import write_json_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, {"participant_id": pid, "participant_key": key})


class _Rate:
    """Tokens per second over a sliding window of recent steps."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._events: list[tuple[float, int]] = []

    def add(self, n: int) -> None:
        now = time.monotonic()
        self._events.append((now, n))
        while self._events and now - self._events[0][0] > self.window_s:
            self._events.pop(0)

    def per_second(self) -> float | None:
        if len(self._events) < 2:
            return None
        span = self._events[-1][0] - self._events[0][0]
        return sum(n for _, n in self._events[1:]) / span if span > 0 else None
