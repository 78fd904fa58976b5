"""`SyncEngine`: one rank's round trip with the coordinator, Δ up and θ down, which every schedule
drives: it owns the sync set's reference copy (the snapshot, on the CPU), its state (reference,
Δ, a download cut short, fetched), error feedback and the byte counters. An FSDP rank's engine
sends and fetches its rows as its piece (`PieceOf`). With compressed downloads
(`train.download_compression`) it also keeps the served model bit for bit (fp32, on the CPU)
and takes each next version as a compressed delta (`wire/delta.py`). See docs/architecture.md.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Literal

import torch

from fedtrain import faults
from fedtrain.config import RunConfig, TransferConfig
from fedtrain.config.privacy import secagg_on
from fedtrain.errors import CoordinatorError, CoordinatorUnavailable, MergeError, ModelMismatchError, RoundClosedError
from fedtrain.merge import check_compatible
from fedtrain.participant.client.coordinator_client import CoordinatorClient
from fedtrain.participant.client.retry import RetryPolicy
from fedtrain.participant.engine.momentum import LocalMomentum
from fedtrain.participant.engine.secagg_sync import Ahead, submit_masked
from fedtrain.participant.engine.served import ServedModel
from fedtrain.participant.engine.sync_set import Only, PieceOf
from fedtrain.privacy.clipping import clip_within
from fedtrain.transport.progress import Progress
from fedtrain.wire import DTYPE_TO_ST, ST_TO_DTYPE, EncodedBody, TensorSpec
from fedtrain.wire.compress import Codec, ErrorFeedback, compress
from fedtrain.wire.format import ROWS_META

__all__ = ["PieceOf", "SyncEngine"]

log = logging.getLogger("fedtrain.participant")

Holds = Literal["reference", "delta", "cut_short", "fetched"]


class SyncEngine:
    """Δ up, θ down, for the sync set `params` of one participant (named `who` in fault
    injection). `patience_s`: how long past a round's deadline we wait for it to close."""

    def __init__(self, client: CoordinatorClient, params: Mapping[str, torch.Tensor], *, who: str | None = None,
                 patience_s: float = 0.0, piece: PieceOf | None = None,
                 shares: Mapping[str, torch.Tensor] | None = None, served: ServedModel | None = None) -> None:
        """`shares`: snapshot tensors of another engine that this one (a fragment's, `fragment`)
        uses as its own; such an engine's downloads name its tensors. `served`: that engine's
        served model (compressed downloads), shared the same way."""
        self.client = client
        self.params = params
        self.who = who
        self.patience_s = patience_s
        self.piece = piece
        self.bytes_up = 0
        self.bytes_down = 0
        self.last_answer: dict[str, Any] | None = None  # the coordinator's answer to our last upload
        self.wait_s = 25.0  # one long-poll of the round's state
        self.cancel = threading.Event()  # set (by another thread) to stop waiting for the round
        self.masks_ahead: Future[Ahead | None] | None = None  # secure aggregation: `secagg_sync.start_ahead`
        self._piece_in: int | None = None  # the round our piece is in (a conflict told us it is)
        self._applied: int | None = None  # asynchronous mode: the round our last upload was applied in
        self._snapshot: dict[str, torch.Tensor] = dict(shares or {})  # else set aside by `prepare`, at join
        self._holds: Holds = "reference"
        self._feedback = ErrorFeedback()
        self._momentum = LocalMomentum()  # `train.upload_momentum`
        self._only = shares is not None
        # Compressed downloads (`deltas`, as the run config says): the served model as it came,
        # bit for bit, and its version; a whole download sets them, a delta moves them on.
        self.deltas = False
        self._served = served if served is not None else ServedModel()

    def fragment(self, names: list[str]) -> SyncEngine:
        """An engine over the tensors `names` of this one's sync set (a Streaming DiLoCo
        fragment), sharing this engine's snapshot tensors: the fragment's reference weights
        are this engine's, so a download of the whole model (`load_global`) sets every
        fragment's. It uploads those tensors only, downloads only them, and keeps its own
        error feedback and byte counts. Call after `prepare`.

        A piece's engine (a rank of a sharded participant) makes a piece's engine: the
        fragment's tensors this rank holds rows of, which may be none (it then waits for the
        round and downloads nothing, as a rank holding no row of the sync set does)."""
        known = self.piece.shapes if self.piece is not None else self._snapshot
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise ModelMismatchError(f"the coordinator's fragment names tensors this model does not sync: "
                                     f"{', '.join(unknown[:5]) or '(none)'}")
        piece = None
        if self.piece is not None:
            names = [n for n in names if n in self._snapshot]
            piece = PieceOf(self.piece.label, self.piece.sends & frozenset(names),
                            {n: r for n, r in self.piece.rows.items() if n in names}, self.piece.shapes)
        engine = SyncEngine(self.client, Only(self.params, names), who=self.who, patience_s=self.patience_s,
                            piece=piece, shares={n: self._snapshot[n] for n in names}, served=self._served)
        engine.wait_s = self.wait_s
        return engine

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of the snapshot: the sync set (a piece's engine: its rows of it)."""
        return sum(t.numel() * t.element_size() for t in self._snapshot.values())

    @property
    def holds(self) -> Holds:
        """What the snapshot holds now: θ_round, Δ, or a download cut short."""
        return self._holds

    def prepare(self, spec: dict[str, dict[str, Any]]) -> None:
        """At join: check the run's model (name -> {"dtype", "shape"}) against our sync set, and
        set aside the snapshot (the model's dtypes as they are now, on the CPU)."""
        self.check_model(spec)
        self._snapshot = {n: torch.empty(tuple(p.shape), dtype=p.dtype) for n, p in self.params.items()}

    # -- the blocking sync ---------------------------------------------------------------------

    def sync(self, r: int, pid: str, config: RunConfig, *, tokens: int, retry: RetryPolicy | None = None) -> int:
        """One blocking round trip for round `r`; the model ends on the new global weights.
        Returns the global version now in the model. On failure the snapshot holds θ_round
        again (or, after a download cut short, the next call downloads without uploading)."""
        version = self.fetch(r, pid, config, tokens=tokens, retry=retry)
        self.adopt()
        return version

    def fetch(self, r: int, pid: str, config: RunConfig, *, tokens: int, retry: RetryPolicy | None = None) -> int:
        """`sync` without the last step: the new global weights end in the snapshot ("fetched"),
        not in the model, until `adopt`. After a download cut short, or a fetch not adopted,
        round r is over: this downloads again without uploading."""
        self.deltas = config.train.download_compression != "none"
        try:
            if self._holds not in ("cut_short", "fetched"):
                self.take_delta()
                if secagg_on(config):  # the masking protocol's steps around a masked upload
                    submit_masked(self, r, pid, config, tokens=tokens, retry=retry)
                else:
                    self.submit(r, pid, self.encode(config), config, tokens=tokens, retry=retry)
            version = self.download(pid, after_round=r, retry=retry, transfer=config.transfer)
        except CoordinatorError:
            self.restore()
            raise
        self._holds = "fetched"
        return version

    def load_global(self, pid: str, *, retry: RetryPolicy | None = None) -> int:
        """Download the global model into the snapshot and the model (at join); its version."""
        version = self.download(pid, retry=retry)
        self.adopt()
        return version

    # -- the steps, which the overlapped sync drives one by one ------------------------------

    def copy_sync_set(self) -> dict[str, torch.Tensor]:
        """θ as it is now, copied to the CPU in the snapshot's dtypes (θ_sent of an overlapped sync)."""
        with torch.no_grad():
            return {n: p.detach().to("cpu", self._snapshot[n].dtype, copy=True) for n, p in self.params.items()}

    def take_delta(self, sent: dict[str, torch.Tensor] | None = None) -> None:
        """Turn the snapshot into Δ = θ_round − θ, with θ the model's weights now or `sent`
        (a `copy_sync_set` of them, for a sync that trains on meanwhile)."""
        with torch.no_grad():
            for n, p in self.params.items():
                theta = sent[n] if sent is not None else p.detach().to("cpu", self._snapshot[n].dtype)
                self._snapshot[n].sub_(theta)
        self._holds = "delta"

    def delta_view(self) -> dict[str, torch.Tensor]:
        """Δ as the snapshot holds it after `take_delta` (the live tensors: do not change them)."""
        if self._holds != "delta":
            raise RuntimeError(f"the snapshot holds {self._holds}, not Δ")
        return dict(self._snapshot)

    def encode(self, config: RunConfig) -> EncodedBody:
        """Δ (held in the snapshot) as a body, compressed as the run config says: the whole of
        it, or (a piece) the tensors and rows this rank sends."""
        t = config.train
        delta = self._snapshot
        meta: dict[str, str] = {}
        if self.piece is not None:
            delta = {n: self._snapshot[n] for n in self._snapshot if n in self.piece.sends}
            rows = {n: r for n, r in self.piece.rows_of(delta).items() if r is not None}
            meta[ROWS_META] = json.dumps(rows)
        elif config.privacy is not None and config.privacy.dp:  # a piece's rows: the coordinator clips the whole
            delta = clip_within(delta, config.privacy.clip_norm)  # a copy if clipped: Δ stays for undo_delta
        if t.upload_momentum > 0:
            delta = self._momentum.step(delta, t.upload_momentum, t.upload_nesterov)
        elif self._momentum.buffer:  # (turned off live: the next upload is Δ itself)
            self._momentum.clear()
        if t.compression == "none" and not self._feedback.residual:  # (a residual: compression was on before)
            return EncodedBody(delta, meta, digest_algorithm=config.digest)
        codec = Codec.for_train(t)
        if t.error_feedback or t.compression == "none":
            self._feedback.decay = t.error_feedback_decay if t.compression != "none" else 1.0
            tensors, packed = self._feedback.compress(delta, codec)
        else:
            tensors, packed = compress(delta, codec)
        return EncodedBody(tensors, {**packed, **meta}, digest_algorithm=config.digest)

    @property
    def upload_residual(self) -> dict[str, torch.Tensor]:
        """The upload error feedback's residual: what compressed uploads have not sent yet."""
        return dict(self._feedback.residual)

    def restore_upload_residual(self, tensors: Mapping[str, torch.Tensor]) -> set[str]:
        """Take the residual an earlier process saved (its local checkpoint) for the tensors of
        this engine's sync set; returns the names taken. A residual that does not fit the tensor
        (shape, a float dtype, finite values) is a ModelMismatchError and nothing is taken."""
        mine = {n: t for n, t in tensors.items() if n in self._snapshot}
        for name, t in mine.items():
            ref = self._snapshot[name]
            if t.shape != ref.shape or not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise ModelMismatchError(f"the saved upload residual of {name} ({t.dtype}, {tuple(t.shape)}) does "
                                         f"not fit the tensor ({ref.dtype}, {tuple(ref.shape)}) or is not finite")
        self._feedback.residual = {n: t.to(self._snapshot[n].dtype) for n, t in mine.items()}
        return set(mine)

    def exchange(self, r: int, pid: str, body: EncodedBody, config: RunConfig, *, tokens: int,
                 retry: RetryPolicy | None = None) -> int:
        """`submit` then `download`: the whole exchange of round `r`, which leaves the new
        global weights in the snapshot (not in the model). Returns their version."""
        self.deltas = config.train.download_compression != "none"
        self.submit(r, pid, body, config, tokens=tokens, retry=retry)
        return self.download(pid, after_round=r, retry=retry, transfer=config.transfer)

    def submit(self, r: int, pid: str, body: EncodedBody, config: RunConfig, *, tokens: int,
               retry: RetryPolicy | None = None) -> bool:
        """Upload `body` as our update to round `r` and wait until the round is no longer open,
        uploading again whenever the coordinator says it has none of ours. False when the
        round had closed before our upload (the caller moves on to the current model)."""
        if self.piece is not None and not self.piece.sends:
            return self._wait_closed(r, config, retry)
        uploaded = self._piece_in == r or self._upload(r, pid, body, tokens, retry, config)
        give_up_at = time.monotonic() + config.round_timeout_s + self.patience_s
        while uploaded:
            info = self._wait_round(self._applied_in(r), pid, retry)
            if info["state"] not in ("open", "closing"):
                break
            if self.cancel.is_set():  # e.g. another rank of our participant failed: its piece is not coming
                raise CoordinatorUnavailable(f"stopped waiting for round {r}: the sync was cancelled", status=0,
                                             code="cancelled")
            if info.get("submitted") is False and info["state"] == "open":
                log.warning("the coordinator has no upload of ours for round %d (restarted?); sending again", r)
                uploaded = self._upload(r, pid, body, tokens, retry, config)
            if time.monotonic() > give_up_at:  # nothing hangs forever, not even a round without quorum
                raise CoordinatorUnavailable(
                    f"round {r} has not closed {config.round_timeout_s:g}s after its deadline: "
                    f"{info.get('reason', 'no reason given')}",
                    status=0,
                    code="unavailable",
                )
        return uploaded

    def _applied_in(self, r: int) -> int:
        """The round our update for round r went into: r, or the one asynchronous mode applied it in."""
        return r if self._applied is None else self._applied

    def _wait_closed(self, r: int, config: RunConfig, retry: RetryPolicy | None) -> bool:
        """A rank of a sharded participant that sends nothing: wait for round r to be merged."""
        give_up_at = time.monotonic() + config.round_timeout_s + self.patience_s
        while self.client.wait_round(r, None, wait_s=self.wait_s, retry=retry)["state"] in ("open", "closing"):
            if self.cancel.is_set():
                raise CoordinatorUnavailable(f"stopped waiting for round {r}: the sync was cancelled", status=0,
                                             code="cancelled")
            if time.monotonic() > give_up_at:
                raise CoordinatorUnavailable(f"round {r} has not closed {config.round_timeout_s:g}s after its "
                                             "deadline", status=0, code="unavailable")
        return True

    def download(self, pid: str, *, after_round: int | None = None, retry: RetryPolicy | None = None,
                 version: int | None = None, transfer: TransferConfig | None = None) -> int:
        """The global model (the newest, or `version`), streamed into the snapshot; returns its
        version. `after_round`: the round whose result this fetches (a sync's download, a fault
        injection point). A piece's engine downloads its rows only. A broken download resumes
        where it stopped; `transfer` (the run config's): how long a silent one is waited for."""
        self._holds = "cut_short"  # until the last byte is in
        if after_round is not None:
            faults.hit("participant.download", who=self.who or pid, round=after_round)
        if self.piece is not None and not self._snapshot:  # a rank that holds no row of any tensor
            self._holds = "reference"
            return -1
        which: dict[str, Any] = {"version": version} if version is not None else {}
        if transfer is not None:
            which.update(stall_timeout_s=transfer.stall_timeout_s, streams=transfer.streams)
        compressed = self._download_compressed(pid, version, retry, transfer, which)
        if compressed is not None:
            self._holds = "reference"
            return compressed
        if self.piece is not None:  # a piece's rows (of a fragment's tensors, for a fragment's engine)
            got, _ = self.client.download(pid=pid, rows=self.piece.rows_of(self._snapshot),
                                          allocate=self._allocate_rows, retry=retry, **which)
        elif self._only:
            got, _ = self.client.download(pid=pid, rows=dict.fromkeys(self._snapshot), allocate=self._allocate_rows,
                                          retry=retry, **which)
        else:
            got, _ = self.client.download(pid=pid, allocate=self._allocate, on_header=self._check_header,
                                          retry=retry, **which)
        version = int(got)
        self._holds = "reference"
        self.bytes_down += self.snapshot_bytes
        return version

    def _download_compressed(self, pid: str, version: int | None, retry: RetryPolicy | None,
                             transfer: TransferConfig | None, which: dict[str, Any]) -> int | None:
        """With compressed downloads (`deltas`; not a piece's engine): the newest version as a
        delta, else whole (kept as served); a version the served model holds already, from it.
        None: the plain path downloads (downloads are not compressed, or a fragment's engine
        asks for another version, `take_global`: its slice, the served copy untouched)."""
        if not self.deltas:
            self._served.forget()
            return None
        if self.piece is not None:
            return None
        if version is not None and version == self._served.version:
            self._into_snapshot(self._served.tensors)
            return version
        if version is not None and self._only:
            return None
        got = self._download_delta(pid, retry, transfer) if version is None else None
        return got if got is not None else self._download_served(pid, retry, which)

    def _download_served(self, pid: str, retry: RetryPolicy | None, which: dict[str, Any]) -> int:
        """The whole model, kept as served (`ServedModel`) and copied into the snapshot."""
        check = None if self._only else self._check_header  # (a fragment's: the whole model was checked at join)
        version, tensors = self._served.take_whole(self.client, pid, check, retry, which)
        self._into_snapshot(tensors)
        self.bytes_down += sum(t.numel() * t.element_size() for t in tensors.values())
        return version

    def _download_delta(self, pid: str, retry: RetryPolicy | None, transfer: TransferConfig | None) -> int | None:
        """The newest version as a compressed delta (`ServedModel.take_delta`); None: download whole."""
        got = self._served.take_delta(self.client, pid, retry, transfer.stall_timeout_s if transfer else None)
        if got is None:
            return None
        version, sent = got
        self._into_snapshot(self._served.tensors)
        self.bytes_down += sent
        return version

    def _into_snapshot(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """The served tensors of our sync set into the snapshot (a fragment's engine: its own)."""
        with torch.no_grad():
            for n, snap in self._snapshot.items():
                snap.copy_(tensors[n])

    def adopt(self, sent: dict[str, torch.Tensor] | None = None) -> None:
        """Put the downloaded weights into the model: as they are, or (`sent`: θ_sent, as
        `take_delta` was given it) plus the local progress made since it was taken."""
        with torch.no_grad():
            for n, p in self.params.items():
                if sent is None:
                    p.copy_(self._snapshot[n])
                else:
                    p.add_((self._snapshot[n] - sent[n]).to(p.device, p.dtype))
        self._holds = "reference"

    def mix(self, alpha: float) -> None:
        """Streaming DiLoCo's apply: θ ← (1 − α)·θ_global + α·θ_local, with θ_global the
        downloaded weights (which stay the reference of the next Δ) and θ_local the model's
        now; as torchft computes it (`θ_global.lerp(θ_local, α)`). α = 0 is `adopt`."""
        if alpha == 0.0:
            self.adopt()
            return
        with torch.no_grad():
            for n, p in self.params.items():
                local = p.detach().to("cpu", self._snapshot[n].dtype)
                p.copy_(self._snapshot[n].lerp(local, alpha).to(p.device, p.dtype))
        self._holds = "reference"

    def undo_delta(self, sent: dict[str, torch.Tensor]) -> None:
        """After a failed exchange whose Δ was taken against `sent` (`take_delta(sent)`): the
        reference back into the snapshot (Δ + θ_sent = θ_round, to rounding). A download cut
        short is left as it is: only a fresh download (`fetch`) mends it."""
        if self._holds != "delta":
            return
        with torch.no_grad():
            for n, t in sent.items():
                self._snapshot[n].add_(t)
        self._holds = "reference"

    def restore(self, sent: dict[str, torch.Tensor] | None = None) -> None:
        """After a failed exchange: θ_round back into the snapshot (Δ + θ = θ_round, to
        rounding), or, with `sent`, θ_sent as the reference of the next Δ (the snapshot may
        hold half a download)."""
        with torch.no_grad():
            if sent is not None:
                for n, t in sent.items():
                    self._snapshot[n].copy_(t)
            elif self._holds == "delta":
                for n, p in self.params.items():
                    self._snapshot[n].add_(p.detach().to("cpu", self._snapshot[n].dtype))
            else:
                return
        self._holds = "reference"

    # -- checks ----------------------------------------------------------------------------------

    def sync_spec(self) -> dict[str, dict[str, Any]]:
        """The tensors we sync, as a join presents them (name -> {"dtype", "shape"}; a piece of a
        sharded model: the whole tensors), so the coordinator can refuse a model that does not match."""
        ours = dict(self.piece.shapes) if self.piece is not None else \
            {n: (p.dtype, tuple(p.shape)) for n, p in self.params.items()}
        return {n: {"dtype": DTYPE_TO_ST[d], "shape": list(shape)} for n, (d, shape) in ours.items()}

    def check_model(self, spec: dict[str, dict[str, Any]]) -> None:
        """Refuse a run whose model (name -> {"dtype", "shape"}) differs from our sync set."""

        def dtype(d: Any) -> torch.dtype:
            return d if isinstance(d, torch.dtype) else ST_TO_DTYPE[d]

        run = {n: (dtype(s["dtype"]), tuple(s["shape"])) for n, s in spec.items()}
        ours = dict(self.piece.shapes) if self.piece is not None else \
            {n: (p.dtype, tuple(p.shape)) for n, p in self.params.items()}
        try:
            check_compatible(run, ours, what="your model")
        except MergeError as e:
            raise ModelMismatchError(f"{e.message} (the run's model is the reference)", details=e.details) from None

    # -- one call each -------------------------------------------------------------------------

    def _upload(self, r: int, pid: str, body: EncodedBody, tokens: int, retry: RetryPolicy | None,
                config: RunConfig) -> bool:
        self._applied = None  # (an answer of an earlier upload must not name this one's round)
        if faults.hit("participant.upload", who=self.who or pid, round=r) == "drop":
            log.warning("fault injected: the upload of round %d is lost on the way", r)
            return True
        label = self.piece.label if self.piece is not None else None
        which = {"piece": label} if label is not None else {}
        try:
            # the run's transfer settings: parts that resume, streams, the stall timeout; the
            # progress of a long upload in the log (every few seconds)
            progress = Progress(f"upload of round {r}", body.content_length, log=log)
            self.last_answer = self.client.upload(r, pid, body, tokens=tokens, retry=retry,
                                                  transfer=config.transfer, progress=progress, **which)
            applied = self.last_answer.get("applied_in") if isinstance(self.last_answer, dict) else None
            self._applied = applied if isinstance(applied, int) and applied >= r else None
        except RoundClosedError as e:
            log.warning("round %d closed before our upload (%s); moving on to the current model", r, e.message)
            return False
        except CoordinatorError as e:
            if e.code != "piece_conflict":
                raise
            # An earlier attempt's piece got in (its answer was lost) and we have trained since:
            # that one counts.
            log.warning("round %d: the coordinator has our piece %r from an earlier attempt; it counts", r, label)
            self._piece_in = r
            return True
        self.bytes_up += body.content_length
        return True

    def _wait_round(self, r: int, pid: str, retry: RetryPolicy | None) -> dict[str, Any]:
        """Long-poll round r. A coordinator that went back past r (it restarted, or a round it had
        served under publish_first failed to commit) answers round_not_open: r is gone, and the
        caller takes the coordinator's current model."""
        try:
            which = {"piece": self.piece.label} if self.piece is not None else {}
            return self.client.wait_round(r, pid, wait_s=self.wait_s, retry=retry, **which)
        except CoordinatorError as e:
            if e.code != "round_not_open":
                raise
            log.warning("round %d is gone (%s); taking the coordinator's current model", r, e.message)
            return {"round": r, "state": "gone"}

    def _allocate(self, spec: TensorSpec) -> torch.Tensor:
        return self._snapshot[spec.name]

    def _allocate_rows(self, spec: TensorSpec) -> torch.Tensor:
        """Where our rows of `spec.name` go: the snapshot, when the coordinator sent those rows."""
        buffer = self._snapshot.get(spec.name)
        if buffer is None or tuple(buffer.shape) != tuple(spec.shape) or buffer.dtype != spec.dtype:
            raise ModelMismatchError(f"the coordinator sent {spec.name} {tuple(spec.shape)} {spec.dtype}, "
                                     "not our rows of it")
        return buffer

    def _check_header(self, specs: dict[str, TensorSpec], metadata: dict[str, str]) -> None:
        self.check_model({n: {"dtype": s.dtype, "shape": list(s.shape)} for n, s in specs.items()})
