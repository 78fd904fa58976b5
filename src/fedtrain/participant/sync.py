"""`SyncEngine`: one participant's round trip with the coordinator, which the blocking and the
overlapped sync both drive.

The engine owns the sync set's reference copy (the snapshot, on the CPU) and the exchange:

    Δ = θ_round − θ  ── upload ── wait for the round to close ── (upload again if the
    coordinator has lost ours: it restarted) ── download θ_{r+1} into the snapshot

The snapshot is always in one of three states: it holds θ_round (the reference of the next
Δ), it holds Δ (between `take_delta` and the download), or a download into it was cut
short (the round is over; only a fresh download mends it). `restore` puts θ_round back
after a failed exchange, so that a later attempt sends the same Δ.

Who runs what: the participant calls `prepare` and `load_global` at join and the blocking
`sync` on the training thread. The overlapped sync (`overlap.py`) calls `copy_sync_set`,
`take_delta` and `encode` on the training thread, `exchange` on its worker thread, then
`restore` (or the participant `adopt`) on the training thread once the worker is done;
while `exchange` runs the training thread calls nothing else of the engine's. Every call to
the coordinator takes the retry budget its caller passes (`retry=`), never a policy set on
the shared client. The byte counters are the engine's: only the thread that runs the
exchange adds to them.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import torch
from torch import nn

from fedtrain import faults
from fedtrain.config import RunConfig
from fedtrain.errors import CoordinatorError, CoordinatorUnavailable, MergeError, ModelMismatchError, RoundClosedError
from fedtrain.merge import check_compatible
from fedtrain.participant.client import CoordinatorClient
from fedtrain.participant.retry import RetryPolicy
from fedtrain.wire import ST_TO_DTYPE, EncodedBody, TensorSpec
from fedtrain.wire.compress import ErrorFeedback, compress

__all__ = ["SyncEngine"]

log = logging.getLogger("fedtrain.participant")

Holds = Literal["reference", "delta", "cut_short"]


class SyncEngine:
    """Δ up, θ down, for the sync set `params` of one participant (named `who` in fault
    injection). `patience_s`: how long past a round's deadline we wait for it to close."""

    def __init__(self, client: CoordinatorClient, params: dict[str, nn.Parameter], *, who: str | None = None,
                 patience_s: float = 0.0) -> None:
        self.client = client
        self.params = params
        self.who = who
        self.patience_s = patience_s
        self.bytes_up = 0
        self.bytes_down = 0
        self._snapshot: dict[str, torch.Tensor] = {}  # set aside by `prepare`, at join
        self._holds: Holds = "reference"
        self._feedback = ErrorFeedback()

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
        try:
            if self._holds != "cut_short":  # else round r is over: fetch the model again
                self.take_delta()
                self.submit(r, pid, self.encode(config), config, tokens=tokens, retry=retry)
            version = self.download(pid, after_round=r, retry=retry)
        except CoordinatorError:
            self.restore()
            raise
        self.adopt()
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

    def encode(self, config: RunConfig) -> EncodedBody:
        """Δ (held in the snapshot) as a body, compressed as the run config says."""
        t = config.train
        if t.compression == "none":
            return EncodedBody(self._snapshot, digest_algorithm=config.digest)
        if t.error_feedback:
            tensors, meta = self._feedback.compress(self._snapshot, t.compression, t.compression_block)
        else:
            tensors, meta = compress(self._snapshot, t.compression, t.compression_block)
        return EncodedBody(tensors, meta, digest_algorithm=config.digest)

    def exchange(self, r: int, pid: str, body: EncodedBody, config: RunConfig, *, tokens: int,
                 retry: RetryPolicy | None = None) -> int:
        """`submit` then `download`: the whole exchange of round `r`, which leaves the new
        global weights in the snapshot (not in the model). Returns their version."""
        self.submit(r, pid, body, config, tokens=tokens, retry=retry)
        return self.download(pid, after_round=r, retry=retry)

    def submit(self, r: int, pid: str, body: EncodedBody, config: RunConfig, *, tokens: int,
               retry: RetryPolicy | None = None) -> bool:
        """Upload `body` as our update to round `r` and wait until the round is no longer open,
        uploading again whenever the coordinator says it has none of ours. False when the
        round had closed before our upload (the caller moves on to the current model)."""
        uploaded = self._upload(r, pid, body, tokens, retry)
        give_up_at = time.monotonic() + config.round_timeout_s + self.patience_s
        while uploaded:
            info = self._wait_round(r, pid, retry)
            if info["state"] not in ("open", "closing"):
                break
            if info.get("submitted") is False and info["state"] == "open":
                log.warning("the coordinator has no upload of ours for round %d (restarted?); sending again", r)
                uploaded = self._upload(r, pid, body, tokens, retry)
            if time.monotonic() > give_up_at:  # nothing hangs forever, not even a round without quorum
                raise CoordinatorUnavailable(
                    f"round {r} has not closed {config.round_timeout_s:g}s after its deadline: "
                    f"{info.get('reason', 'no reason given')}",
                    status=0,
                    code="unavailable",
                )
        return uploaded

    def download(self, pid: str, *, after_round: int | None = None, retry: RetryPolicy | None = None) -> int:
        """The global model, streamed into the snapshot; returns its version. `after_round`:
        the round whose result this fetches (a sync's download, a fault injection point)."""
        self._holds = "cut_short"  # until the last byte is in
        if after_round is not None:
            faults.hit("participant.download", who=self.who or pid, round=after_round)
        version, _ = self.client.download(pid=pid, allocate=self._allocate, on_header=self._check_header, retry=retry)
        self._holds = "reference"
        self.bytes_down += sum(t.numel() * t.element_size() for t in self._snapshot.values())
        return int(version)

    def adopt(self, sent: dict[str, torch.Tensor] | None = None) -> None:
        """Put the downloaded weights into the model: as they are, or (`sent`: θ_sent, as
        `take_delta` was given it) plus the local progress made since it was taken."""
        with torch.no_grad():
            for n, p in self.params.items():
                if sent is None:
                    p.copy_(self._snapshot[n])
                else:
                    p.add_((self._snapshot[n] - sent[n]).to(p.device, p.dtype))

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

    def check_model(self, spec: dict[str, dict[str, Any]]) -> None:
        """Refuse a run whose model (name -> {"dtype", "shape"}) differs from our sync set."""

        def dtype(d: Any) -> torch.dtype:
            return d if isinstance(d, torch.dtype) else ST_TO_DTYPE[d]

        run = {n: (dtype(s["dtype"]), tuple(s["shape"])) for n, s in spec.items()}
        ours = {n: (p.dtype, tuple(p.shape)) for n, p in self.params.items()}
        try:
            check_compatible(run, ours, what="your model")
        except MergeError as e:
            raise ModelMismatchError(f"{e.message} (the run's model is the reference)", details=e.details) from None

    # -- one call each -------------------------------------------------------------------------

    def _upload(self, r: int, pid: str, body: EncodedBody, tokens: int, retry: RetryPolicy | None) -> bool:
        if faults.hit("participant.upload", who=self.who or pid, round=r) == "drop":
            log.warning("fault injected: the upload of round %d is lost on the way", r)
            return True
        try:
            self.client.upload(r, pid, body, tokens=tokens, retry=retry)
        except RoundClosedError as e:
            log.warning("round %d closed before our upload (%s); moving on to the current model", r, e.message)
            return False
        self.bytes_up += body.content_length
        return True

    def _wait_round(self, r: int, pid: str, retry: RetryPolicy | None) -> dict[str, Any]:
        """Long-poll round r. A coordinator that went back past r (it restarted, or a round it had
        served under publish_first failed to commit) answers round_not_open: r is gone, and the
        caller takes the coordinator's current model."""
        try:
            return self.client.wait_round(r, pid, wait_s=25.0, retry=retry)
        except CoordinatorError as e:
            if e.code != "round_not_open":
                raise
            log.warning("round %d is gone (%s); taking the coordinator's current model", r, e.message)
            return {"round": r, "state": "gone"}

    def _allocate(self, spec: TensorSpec) -> torch.Tensor:
        return self._snapshot[spec.name]

    def _check_header(self, specs: dict[str, TensorSpec], metadata: dict[str, str]) -> None:
        self.check_model({n: {"dtype": s.dtype, "shape": list(s.shape)} for n, s in specs.items()})
