"""Overlapped sync: training goes on while the round's upload, merge and download happen.

At the H-th step the participant sends Δ = θ_round − θ_sent and keeps training at once; a
background thread uploads, waits for the round to close and downloads θ_{r+1} into the
snapshot buffers. When that is done (checked at every step, waited for at the next sync
point at the latest) the weights become θ_{r+1} + (θ − θ_sent): the new global model plus
the local progress made meanwhile — the one-round-delayed outer update of overlapped
DiLoCo. θ_{r+1} is the reference of the next Δ, which therefore carries all local
progress since the send. Extra memory: one copy of the sync set (θ_sent).

Only the background thread talks to the coordinator while an exchange is pending
(heartbeats have their own client); everything that touches the model runs on the
training thread.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fedtrain.errors import CoordinatorError, CoordinatorUnavailable
from fedtrain.participant.outage import is_transient

if TYPE_CHECKING:
    from fedtrain.participant.runner import Participant

log = logging.getLogger("fedtrain.participant")


@dataclass
class _Pending:
    future: Future[int]
    sent: dict[str, torch.Tensor]
    record: dict[str, Any]
    round: int


class OverlappedSync:
    """The background half of a participant's sync."""

    def __init__(self, fed: Participant) -> None:
        self.fed = fed
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fedtrain-sync")
        self._pending: _Pending | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def start(self) -> None:
        """At the H-th step: send this round's Δ in the background and return at once."""
        fed = self.fed
        t0 = time.perf_counter()
        if self._pending is not None:  # the previous exchange is late: wait for it
            self.finish()
            if fed.finished:
                return
        r = fed.round
        record = fed._open_record(r)
        with torch.no_grad():
            sent = {n: p.detach().to("cpu", fed._snapshot[n].dtype, copy=True) for n, p in fed._params.items()}
            for n, t in sent.items():
                fed._snapshot[n].sub_(t)
        body = fed._encode_delta()
        fed._reset_round()
        self._pending = _Pending(self._pool.submit(self._exchange, r, body), sent, record, r)
        fed.sync_seconds += time.perf_counter() - t0

    def _exchange(self, r: int, body: Any) -> int:
        """Background thread: upload, wait for the round, download θ_{r+1} into the snapshot."""
        fed = self.fed
        uploaded = fed._upload(r, body)
        give_up_at = time.monotonic() + fed.config.round_timeout_s + fed._outage_budget_s
        while uploaded:
            info = fed._wait_round(r)
            if info["state"] not in ("open", "closing"):
                break
            if info.get("submitted") is False and info["state"] == "open":
                uploaded = fed._upload(r, body)
            if time.monotonic() > give_up_at:
                raise CoordinatorUnavailable(f"round {r} has not closed in time: {info.get('reason')}", status=0,
                                             code="unavailable")
        version, _ = fed.client.download(pid=fed.participant_id, allocate=fed._allocate, on_header=fed._check_header)
        return int(version)

    def poll(self) -> None:
        """At every step: apply a finished exchange."""
        if self._pending is not None and self._pending.future.done():
            self.finish()

    def finish(self) -> None:
        """Apply the exchange's result (waiting for it if needed)."""
        fed, pending = self.fed, self._pending
        assert pending is not None
        self._pending = None
        t0 = time.perf_counter()
        try:
            version = pending.future.result()
        except CoordinatorError as e:
            if not is_transient(e):
                raise
            # The round's contribution is lost; keep the local progress and measure the next
            # Δ from the weights we sent (the download may have half-filled the snapshot).
            log.warning("overlapped sync of round %d failed (%s); continuing from local weights", pending.round,
                        e.message)
            with torch.no_grad():
                for n, t in pending.sent.items():
                    fed._snapshot[n].copy_(t)
            return
        fed.bytes_down += sum(t.numel() * t.element_size() for t in fed._snapshot.values())
        fed.round = version
        fed.finished = fed.config.rounds > 0 and version >= fed.config.rounds
        with torch.no_grad():
            for n, p in fed._params.items():
                if fed.finished:  # the run is over: end exactly on the global model
                    p.copy_(fed._snapshot[n])
                else:
                    p.add_((fed._snapshot[n] - pending.sent[n]).to(p.device, p.dtype))
        fed._close_record(pending.record, pending.round, time.perf_counter() - t0, reset=False)

    def close(self) -> None:
        """Finish a pending exchange (so the last round lands) and stop the thread."""
        try:
            if self._pending is not None:
                self.finish()
        finally:
            self._pool.shutdown(wait=False)
