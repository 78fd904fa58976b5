"""Streaming DiLoCo on the participant: one fragment's exchange per round, overlapped with τ steps.

The coordinator splits the sync set into K fragments (its plan comes in the join answer)
and round r syncs fragment r mod K, every S = H/K inner steps. Each fragment has its own
`SyncEngine` (`SyncEngine.fragment`), which shares the participant engine's snapshot: the
snapshot holds every fragment's global weights θ_g^p, the reference of its next Δ. A round:

    step S − τ:  Δ^p = θ_g^p − θ^p, sent on a worker thread (τ = 0: at step S, blocking)
    steps ...:   training goes on, every parameter (fragment p's too)
    step S:      wait for the round's result, download θ_g^p (fragment p only), then
                 θ^p ← (1 − α)·θ_g^p + α·θ^p (`SyncEngine.mix`); θ_g^p stays the reference

as torchft 0.2.0 does it (`fedtrain.streaming`). In the overlapped mode (`train.overlap`)
training does not wait at step S: the result is applied at the first step it is there, and
the next round's count starts then. K = 1, τ = 0, α = 0 is plain DiLoCo, bit for bit.

`FragmentSync` owns the worker thread and the exchange in flight, nothing of the
participant's; the participant (`runner.py`) decides when to send and land. Everything
that touches the model runs on the training thread. An FSDP rank (`fsdp.py`, τ = 0 only)
uses it over its own rows: its fragments' engines are piece engines (`SyncEngine.fragment`).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from fedtrain.config import RunConfig
from fedtrain.errors import CoordinatorError, ModelMismatchError
from fedtrain.participant.retry import RetryPolicy
from fedtrain.participant.sync import SyncEngine

__all__ = ["FragmentSync", "Sent", "plan_of"]

log = logging.getLogger("fedtrain.participant")


def plan_of(joined: dict[str, Any]) -> list[list[str]] | None:
    """The coordinator's fragments (one list of tensor names per fragment) from a join answer,
    or None when the run does not stream. Refuses an answer without a usable plan."""
    streaming = joined.get("streaming")
    if streaming is None:
        if joined.get("config", {}).get("streaming") is not None:
            raise ModelMismatchError("the run streams (config streaming is set) but the coordinator sent no "
                                     "fragment plan; it is older than this participant")
        return None
    fragments = streaming.get("fragments") if isinstance(streaming, dict) else None
    if not isinstance(fragments, list) or not fragments or not all(
            isinstance(f, list) and f and all(isinstance(n, str) for n in f) for f in fragments):
        raise ModelMismatchError("the coordinator's fragment plan is not a list of lists of tensor names")
    return fragments


@dataclass
class Sent:
    """A fragment's exchange in flight: the round, the fragment, the weights its Δ was taken
    against (θ_sent) and the worker's future (the new version)."""

    round: int
    fragment: int
    sent: dict[str, torch.Tensor]
    future: Future[int]


class FragmentSync:
    """The K fragments' engines of one participant, and the one exchange that may be in flight."""

    def __init__(self, engine: SyncEngine, fragments: list[list[str]]) -> None:
        self.engine = engine  # the whole sync set's: the join's download, and a resync
        self.engines = [engine.fragment(names) for names in fragments]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fedtrain-fragment")
        self.pending: Sent | None = None

    @property
    def k(self) -> int:
        return len(self.engines)

    def of(self, r: int) -> int:
        """The fragment round `r` syncs."""
        return r % self.k

    @property
    def ready(self) -> bool:
        """Whether the exchange in flight is done, so that `land` returns at once."""
        return self.pending is not None and self.pending.future.done()

    @property
    def bytes_up(self) -> int:
        return sum(e.bytes_up for e in self.engines)

    @property
    def bytes_down(self) -> int:
        return sum(e.bytes_down for e in self.engines)

    def send(self, r: int, pid: str, config: RunConfig, *, tokens: int, retry: RetryPolicy | None) -> None:
        """Take round r's fragment Δ now and send it on the worker thread; returns at once."""
        if self.pending is not None:
            raise RuntimeError("a fragment's exchange is still in flight: land it first")
        p = self.of(r)
        engine = self.engines[p]
        sent = engine.copy_sync_set()
        engine.take_delta(sent)
        body = engine.encode(config)
        future = self._pool.submit(engine.exchange, r, pid, body, config, tokens=tokens, retry=retry)
        self.pending = Sent(r, p, sent, future)

    def wait(self) -> tuple[Sent, int]:
        """Wait for the exchange in flight: it, and the version now in its fragment's snapshot
        (not yet in the model: `mix`). On a failure the fragment's reference is back (or its
        download was cut short, which the next `fetch` mends) and the error is raised."""
        pending = self.pending
        if pending is None:
            raise RuntimeError("no fragment's exchange is in flight")
        self.pending = None
        try:
            return pending, pending.future.result()
        except CoordinatorError:
            self.engines[pending.fragment].undo_delta(pending.sent)
            raise

    def fetch(self, r: int, pid: str, config: RunConfig, *, tokens: int, retry: RetryPolicy | None) -> int:
        """Round r's fragment exchange on this thread (τ = 0, or an attempt after a failure): Δ
        now, upload, wait, download into the snapshot. Returns the version; on a failure the
        reference is back, as `SyncEngine.fetch` leaves it, and the error is raised."""
        return self.engines[self.of(r)].fetch(r, pid, config, tokens=tokens, retry=retry)

    def mix(self, fragment: int, alpha: float) -> list[str]:
        """Fragment `fragment`'s downloaded weights into the model: θ ← (1 − α)·θ_g + α·θ. Returns
        the names of the tensors it changed."""
        self.engines[fragment].mix(alpha)
        return list(self.engines[fragment].params)

    def take_global(self, pid: str, version: int, have: int, *, retry: RetryPolicy | None) -> list[str] | None:
        """At the end of the run: the model takes global version `version` whole. Fragment `have`
        (just mixed in) is already in its snapshot; every other fragment is downloaded. Returns
        which tensors changed, as `mix` does: None, all of them."""
        for p, engine in enumerate(self.engines):
            if p != have:
                engine.download(pid, version=version, retry=retry)
            engine.adopt()
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False)
