"""The coordinator's service: a run's parts, put together, and every operation on the run.

Routes (`http/routes/`) parse and authorize, then call this service; `Coordinator` hands
each request to the part that owns what it concerns (the rooms of `coordinator/`) and
reports the status. `Coordinator.inspect()` is the one documented look inside (`inspection.py`).

More: docs/architecture.md, "coordinator/service.py".
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedtrain import faults
from fedtrain.config import RunConfig
from fedtrain.coordinator import lifecycle
from fedtrain.coordinator.inspection import Inspection, inspect_run, model_view
from fedtrain.coordinator.intake.attempts import Attempts
from fedtrain.coordinator.intake.flow import Intake
from fedtrain.coordinator.intake.parts import PartClaim
from fedtrain.coordinator.intake.pieces import check_label
from fedtrain.coordinator.intake.uploads import Uploads
from fedtrain.coordinator.members.auth import Identity, Tokens, require_admin
from fedtrain.coordinator.members.roster import Live, Roster
from fedtrain.coordinator.model.committer import Committer
from fedtrain.coordinator.model.deltas import DeltaStream
from fedtrain.coordinator.model.downloads import Tracked
from fedtrain.coordinator.model.global_eval import GlobalEvaluator
from fedtrain.coordinator.model.publish import ModelStream
from fedtrain.coordinator.model.slices import SliceStream
from fedtrain.coordinator.policy import ReceivePath
from fedtrain.coordinator.rounds.progress import Rounds
from fedtrain.coordinator.rounds.schedule import Schedule
from fedtrain.coordinator.secagg import SecureAggregation
from fedtrain.coordinator.state.broadcast import Broadcaster
from fedtrain.coordinator.state.config_versions import ConfigVersions
from fedtrain.coordinator.state.events import Events
from fedtrain.coordinator.state.statelock import StateLock
from fedtrain.coordinator.state.store import ParticipantRow, Store
from fedtrain.coordinator.status import run_status
from fedtrain.errors import MergeError, Refused
from fedtrain.merge import all_finite, check_compatible
from fedtrain.transport import Body
from fedtrain.wire import DTYPE_TO_ST, ST_TO_DTYPE

log = lifecycle.log

__all__ = ["Coordinator", "Live", "Refused", "all_finite", "frozen_base_fingerprint", "initial_weights"]

initial_weights = lifecycle.initial_weights
frozen_base_fingerprint = lifecycle.frozen_base_fingerprint


class Coordinator:
    """A run's parts and every operation on it. Create, `open()`, then `await start()`."""

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
        self.lock = lock  # the state dir's OS lock: taken by the caller early, else at open()
        self.config_path = config_path
        self.tokens = tokens or Tokens()
        self.clock = clock
        self.events = Events()
        # How to open the run (`lifecycle.open_run`): on a resumed run the stored config wins
        # over `config` unless `apply_config`; `recover` resumes from the newest intact kept
        # version when the newest checkpoint is damaged; `fast_io` switches the transport's fast
        # paths (checkpoint writes, the receive into the sum) on or off (None: FEDTRAIN_FAST_IO).
        self._given = lifecycle.Given(config, init_weights, apply_config, recover, fast_io)
        self.fold_lock = threading.Lock()  # the intake's; the committer takes it to realign and reconfigure
        # The parts, made by `open()`.
        self.store: Store
        self.spool: Path
        self.spec: dict[str, tuple[torch.dtype, tuple[int, ...]]]
        self.configs: ConfigVersions
        self.committer: Committer
        self.intake: Intake
        self.roster: Roster
        self.rounds: Rounds
        self.uploads: Uploads
        self.schedule: Schedule
        self._global_eval: GlobalEvaluator | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def open(self) -> None:
        """Load the run from the state directory, or create it; never loads a partial round.
        The directory is locked first: a second coordinator on it is refused before it touches
        anything (`statelock.py`)."""
        if self.lock is None or not self.lock.held:
            self.lock = StateLock.acquire(self.state_dir)
        try:
            parts = lifecycle.open_run(self.state_dir, self._given, self.config_path, self.events, self.tokens,
                                       self.now, self.fold_lock)
        except BaseException:
            self.lock.release()
            raise
        self.store, self.spool, self.spec = parts.store, parts.spool, parts.spec
        self.configs, self.committer, self.intake = parts.configs, parts.committer, parts.intake
        self.roster, self.rounds, self.uploads = parts.roster, parts.rounds, parts.uploads
        self.schedule = parts.schedule

    async def start(self) -> None:
        self.events.start()
        self.rounds.start()
        self._global_eval = GlobalEvaluator(self.store, self.committer, lambda: self.configs.config)
        self._global_eval.start()  # does nothing unless the config names eval.global_data
        if self.config_path is not None:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload_config_file)

    def stop_waiting(self) -> None:
        """The server is stopping: long polls answer at once and event streams end (on the event loop)."""
        self.events.stop_waiting()

    async def stop(self) -> None:
        try:
            await self._stop()
        finally:  # whatever went wrong on the way out, the state dir is free for the next one
            if self.lock is not None:
                self.lock.release()

    async def _stop(self) -> None:
        await self.rounds.stop()
        self.events.close()
        self.committer.stop()
        if self._global_eval is not None:
            self._global_eval.stop()
        try:  # a participant's downloads since its row was last stored count too
            self.roster.store_all()
        except sqlite3.Error as e:
            log.warning("the participants' counters could not be stored at the stop: %s", e)
        self.store.close()

    # -- what the run is now (read only) -----------------------------------------------------------

    def now(self) -> float:
        """The coordinator's clock, as every part reads it (`clock` may be replaced, in tests)."""
        return self.clock()

    @property
    def broadcast(self) -> Broadcaster:
        """The event stream's fan-out (`/v1/stream` subscribes to it, `/metrics` counts it)."""
        return self.events.broadcast

    @property
    def config(self) -> RunConfig:
        """The config in force for the open round."""
        return self.configs.config

    @property
    def config_file_diff(self) -> dict[str, list[Any]]:
        """The given config against the stored one at a restart, not applied."""
        return self.configs.file_diff

    @property
    def version(self) -> int:
        """The open round (the newest version is the one its merge will commit, less one)."""
        return self.rounds.version

    @property
    def finished(self) -> bool:
        return self.rounds.finished

    def inspect(self) -> Inspection:
        """What the run holds inside, beyond its status: for a debugger, an embedding program
        and tests that check state no API shows (the global model's master weights, the open
        round's sum, the rows behind the status). Read only: the tensors and rows are the live
        ones, not copies; change them and the run changes. Event loop thread."""
        return inspect_run(self.committer, self.rounds, self.intake, self.roster)

    def deadline(self) -> tuple[float, str]:
        return self.rounds.deadline()

    def rounds_total(self) -> int:
        """The rounds the run has in all (0: no end): the config's `rounds`, or, for a run that
        finished past it, the rounds it committed. A config in force with fewer rounds than
        were already committed (lowered live, or a restart with another --config) finishes the
        run where it stands; its total is then the committed count, not the lower figure, so
        that the open round never reads as past the end (`round 408/400`)."""
        return self.version if self.finished else self.config.rounds

    def model_spec(self) -> dict[str, dict[str, Any]]:
        return {n: {"dtype": DTYPE_TO_ST[d], "shape": list(s)} for n, (d, s) in self.spec.items()}

    # -- participants ------------------------------------------------------------------------------

    def join(self, ident: Identity, name: str | None, info: dict[str, Any], key: str | None = None,
             model: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """Join as `name` (a new one when None), presenting the participant key of an earlier
        join (`key`) or not; the answer carries the key to present from now on. `model`: the
        tensors the participant syncs (name -> dtype, shape); one that differs from the run's is
        refused (409 model_mismatch), before anything is added to the roster."""
        if model is not None:
            self.check_model(model)
        # The join is done only once its answer is built: one that fails leaves no roster row behind.
        with self.roster.joining(ident, name, info, key, self.version, self.config) as (name, issued):
            faults.hit("join.answer", who=name)
            answer = {
                "participant_id": name,
                "participant_key": issued,
                "run": self.config.name,
                "config": self.config.model_dump(mode="json"),
                "config_version": self.configs.version,
                "current_round": self.version,
                "finished": self.finished,
                "model": self.model_spec(),
                "assignment": self.schedule.tell(name, self.version, self.version, self.config,
                                                 self.roster.reported(name)),
                # Streaming DiLoCo: the tensors of each fragment (round r syncs fragment r mod k); None: off
                "streaming": self.rounds.plan.view() if self.rounds.plan is not None else None,
            }
        for round_, n in self.intake.drop_pieces(name):  # sent by the process that joined before this one
            self.events.record("pieces", f"{name} joined again: the {n} piece(s) of its update for round {round_} "
                               "that came before are dropped; its update comes whole from the new process", name)
        self.events.notify()
        return answer

    def check_model(self, model: dict[str, dict[str, Any]]) -> None:
        """Refuse (409 model_mismatch, every difference listed) a participant's sync set that is
        not the run's model: a participant that cannot submit must not join and hold rounds up."""
        given: dict[str, tuple[torch.dtype | str, tuple[int, ...]]] = {
            n: (ST_TO_DTYPE.get(s["dtype"], s["dtype"]), tuple(s["shape"])) for n, s in model.items()}
        try:
            check_compatible(self.spec, given, what="your model")  # type: ignore[arg-type]
        except MergeError as e:
            raise Refused(409, "model_mismatch", f"your model does not match the run's: {e.message}",
                          e.details) from None

    def act_as(self, ident: Identity, pid: str, key: str | None) -> ParticipantRow:
        """The check of every request that speaks for participant `pid` (`Roster.act_as`)."""
        return self.roster.act_as(ident, pid, key)

    def heartbeat(self, ident: Identity, pid: str, stats: dict[str, Any]) -> dict[str, Any]:
        p, back = self.roster.heartbeat(ident, pid, stats, self.config)
        if back:
            self.events.notify()
        return {"current_round": self.version, "finished": self.finished, "state": p.state,
                "config_version": self.configs.version}

    def leave(self, ident: Identity, pid: str) -> dict[str, Any]:
        self.roster.leave(ident, pid)
        self.intake.abort_direct(pid)
        self.intake.parts.drop_where(lambda k: k[0] != pid)  # its uploads in parts will not be finished
        self.rounds.maybe_close()
        self.events.notify()
        return {"left": True}

    def add_metrics(self, ident: Identity, pid: str, round_: int | None, step: int | None,
                    values: dict[str, float]) -> None:
        self.roster.add_metrics(ident, pid, round_, step, values)

    def evict(self, ident: Identity, pid: str) -> dict[str, Any]:
        """Admin: remove a participant from the run; it may not rejoin under that name."""
        self.roster.evict(ident, pid, self.config)
        self.intake.parts.drop_where(lambda k: k[0] != pid)
        self.rounds.maybe_close()
        self.events.notify()
        return {"evicted": pid}

    def token_view(self, ident: Identity) -> dict[str, Any]:
        """Admin: the participant tokens by fingerprint, whether revoked, who joined with each."""
        return self.roster.token_view(ident)

    def mint_token(self, ident: Identity, name: str) -> dict[str, Any]:
        """Admin: a new participant token for site `name`, stored as its sha256 only; the answer
        is the one time the token is shown (`SiteTokens.mint`)."""
        result = self.roster.mint_token(ident, name)
        self.events.notify()
        return result

    def adopt_tokens(self, name: str, tokens: list[str]) -> list[str]:
        """Keep tokens given in a legacy tokens.json as named tokens `name`, `name-2`, ..."""
        return self.roster.adopt_tokens(name, tokens)

    def named_tokens(self) -> int:
        """How many named participant tokens the run holds (revoked ones too)."""
        return self.roster.named_tokens()

    def revoke_token(self, ident: Identity, token_id: str | None, participant_id: str | None,
                     name: str | None = None) -> dict[str, Any]:
        """Admin: refuse a participant token from now on (kept across restarts); its participants are evicted."""
        result = self.roster.revoke_token(ident, token_id, participant_id, name)
        self.rounds.maybe_close()
        self.events.notify()
        return result

    # -- rounds, uploads, downloads ------------------------------------------------------------------

    async def receive_update(self, ident: Identity, pid: str, round_: int, tokens: int, digest: str,
                             length: int | None, body: Any, piece: str | None = None) -> dict[str, Any]:
        """Verify and fold one participant's pseudo-gradient for `round_`, or one `piece` of
        it (`uploads.py`, `pieces.py`)."""
        return await self.uploads.receive_update(ident, pid, round_, tokens, digest, length, Body.of(body), piece)

    async def receive_part(self, ident: Identity, pid: str, round_: int, claim: PartClaim, digest: str,
                           length: int | None, body: Any, piece: str | None = None) -> dict[str, Any]:
        """One part of an update that travels in parts (`intake/parts.py`)."""
        return await self.uploads.receive_part(ident, pid, round_, claim, digest, length, Body.of(body), piece)

    def part_session(self, ident: Identity, pid: str, round_: int, piece: str | None = None) -> dict[str, Any]:
        """Which parts of `pid`'s upload in parts for `round_` are held (a resumed upload sends the rest)."""
        return self.uploads.part_session(ident, pid, round_, piece)

    @property
    def attempts(self) -> Attempts:
        """The upload attempts in progress (a newer one takes over: `intake/attempts.py`)."""
        return self.intake.attempts

    async def wait_round(self, ident: Identity, pid: str | None, round_: int, wait_s: float,
                         piece: str | None = None) -> dict[str, Any]:
        """Long-poll until round `round_` is closed, or `wait_s` (`Rounds.wait_round`). With
        `piece`, `pid`'s update counts as in while that piece of it is (`Intake.has_piece`)."""
        if pid is None:
            return await self.rounds.wait_round(None, round_, wait_s)
        self.roster.get(ident, pid)
        if piece is None:
            return await self.rounds.wait_round(pid, round_, wait_s)
        check_label(piece)
        return await self.rounds.wait_round(pid, round_, wait_s,
                                            piece_in=lambda: self.intake.has_piece(pid, round_, piece))

    def round_info(self, round_: int, pid: str | None = None) -> dict[str, Any]:
        return self.rounds.round_info(round_, pid)

    def secure_aggregation(self) -> SecureAggregation:
        """The run's secure aggregation (`/v1/rounds/{r}/secagg/...`); 409 secagg_off without it."""
        if self.rounds.secagg is None:
            raise Refused(409, "secagg_off", "this run does not use secure aggregation (privacy.secure_aggregation)")
        return self.rounds.secagg

    def model_stream(self, version: int | None, pid: str | None = None) -> ModelStream:
        """A download of global version `version` (default: the newest), counted in full as
        participant `pid`'s (a download of a byte range of it: `begin_download`)."""
        stream = self.rounds.model_stream(version)
        self.roster.counted_download(pid, stream.size)
        return stream

    async def model_slice(self, version: int | None, pid: str | None, rows: str) -> SliceStream:
        """A download of some rows of version `version` (`rows`: JSON, see `slices.parse_rows`)."""
        stream = await self.rounds.model_slice(version, rows)
        self.roster.counted_download(pid, stream.size)
        return stream

    def model_delta(self, from_version: int) -> DeltaStream:
        """A download of the newest version as the compressed delta from `from_version`
        (404/409 when there is none: the participant downloads the model whole)."""
        return self.committer.delta_stream(self.rounds.version, from_version)

    def begin_download(self, who: str | None, pid: str | None, etag: str, what: str, length: int,
                       version: int | None = None, fp32_scale: float = 1.0) -> Tracked:
        """A download of `length` bytes (the range asked for) of `version` starts: in flight under
        `who` (a participant, or a token for one that named none; None: an admin's, not shown) for
        the status and the per-participant cap (`downloads.DownloadsInFlight`: 429
        too_many_downloads past it); the bytes it sends count as participant `pid`'s when it ends,
        and (a participant's) as the bytes down of the round that made `version`; `fp32_scale`:
        the whole model's bytes per byte of this body (a compressed delta's, for the status)."""
        def counted(sent: int) -> None:
            self.roster.counted_download(pid, sent)
            if who is not None and version is not None:
                self.committer.downloads.sent_of(version, sent, round(sent * fp32_scale))

        if who is None:
            return Tracked(None, None, counted)
        return self.committer.downloads.begin(who, etag, what, length, counted)

    def tick(self) -> None:
        """Periodic duties: fail silent participants, close rounds whose deadline passed."""
        self.rounds.tick()

    def kept_versions(self, ident: Identity) -> dict[str, Any]:
        """Admin: the committed versions whose checkpoint files are kept (a roll back's choices)."""
        require_admin(ident, "listing the kept versions")
        return {"versions": self.committer.kept_versions(), "committed_version": self.committer.committed_version}

    async def roll_back_to(self, ident: Identity, version: int) -> dict[str, Any]:
        """Admin: put a kept version's weights and optimizer state back in force (`Rounds.roll_back_to`)."""
        require_admin(ident, "rolling the run back")
        return await self.rounds.roll_back_to(version, ident.role)

    # -- the config -----------------------------------------------------------------------------------

    def config_view(self, round_: int | None, pid: str | None = None) -> dict[str, Any]:
        """The config in force at `round_` (default: now), with the newest accepted version; for
        participant `pid` (already authorized) also its inner steps for that round (`assignment`,
        `Schedule.tell`: in balanced rounds fixed once told)."""
        view = self.configs.view(round_, self.version)
        view["model"] = self.model_view()
        if pid is not None:
            cfg = self.configs.for_round(view["round"], self.version)
            view["assignment"] = self.schedule.tell(pid, view["round"], self.version, cfg, self.roster.reported(pid))
        return view

    def model_view(self) -> dict[str, Any]:
        """What the run's model is, recipe or custom (`inspection.model_view`)."""
        return model_view(self.store, self.spec)

    def validate_config(self, ident: Identity, patch: Any) -> dict[str, Any]:
        """Dry run of a change: valid or not, the reason, and the diff it would make."""
        return self.configs.validate(ident, patch)

    def change_config(self, ident: Identity, patch: Any, *, author: str | None = None) -> dict[str, Any]:
        """Accept a live change (validated against the newest version) as a new version that
        takes effect at the next round boundary — at once if no one has started this round."""
        if author is None:
            require_admin(ident, "changing the config")
        started = bool(self.rounds.open.submitted) or bool(self.roster.active())
        result = self.configs.change(patch, author or ident.role, self.version, started)
        if result["changed"] and result["effective_round"] == self.version:
            self.rounds.enter_round()
            self.events.notify()
        return result

    def reload_config_file(self) -> None:
        """SIGHUP: apply what changed in the config file since it was last read, as a live
        change (a three-way merge that keeps the admin's live changes: `ConfigVersions.file_patch`).
        An invalid file changes nothing."""
        from fedtrain.errors import ConfigError

        found = self.configs.file_patch()
        if found is None:
            return
        patch, kept, file_now = found
        try:
            result = self.change_config(Identity("admin", "file"), patch, author="file")
        except ConfigError as e:
            self.events.record("config", f"reload of {self.config_path} refused: {e.message}")
            return
        self.configs.file_applied(file_now, result["changed"], kept)

    # -- status ---------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The run's status (`coordinator/status.py`: what each part holds now, as JSON)."""
        return run_status(config=self.config, spec=self.spec, store=self.store, roster=self.roster,
                          intake=self.intake, schedule=self.schedule, rounds=self.rounds, committer=self.committer,
                          configs=self.configs, version=self.version, finished=self.finished,
                          deadline=self.deadline(), rounds_total=self.rounds_total())

    # -- reads for the routes (`http/routes/`): through these, never the store or round state -----

    def config_history(self, limit: int = 50) -> list[dict[str, Any]]:
        """The newest `limit` accepted config versions: when, by whom, the diff."""
        return self.store.config_history(limit)

    def has_piece(self, pid: str, round_: int, label: str) -> bool:
        """Whether piece `label` of `pid`'s update for round `round_` is in (held until its update is whole)."""
        return self.intake.has_piece(pid, round_, label)

    def last_receive_path(self) -> ReceivePath | None:
        """Where the latest upload was received (spooled, or straight into the sum), and why."""
        return self.intake.last_path

    def round_history(self, limit: int = 50) -> list[dict[str, Any]]:
        """The newest `limit` committed rounds, newest first: when, why they closed, and each
        submission with its weight."""
        return self.store.rounds(limit)

    def submissions(self, round_: int) -> list[dict[str, Any]]:
        """The updates received for round `round_`, in the order they came: who, tokens, digest."""
        return self.store.submissions(round_)

    def version_digest(self, version: int) -> str | None:
        """The digest of committed version `version`'s global model (None: not known)."""
        return self.store.get_meta(f"digest/{version}")

    def event_log(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest `limit` events of the run, oldest first."""
        return self.store.events(limit)

    def metrics(self, name: str | None = None, limit: int = 10000) -> list[dict[str, Any]]:
        """The newest `limit` reported metrics (only those called `name`, if given)."""
        return self.store.metrics(name, limit)

    def round_timings(self) -> list[tuple[float, float]]:
        """(duration_s, merge_s) of every committed round, oldest first."""
        return self.store.round_timings()
