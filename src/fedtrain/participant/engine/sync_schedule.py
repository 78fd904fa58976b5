"""The schedule of a participant's syncs: which fragment a round moves, when its Δ is sent, how the
result lands. One component for every way a site syncs:

| schedule                     | fragments | sent at step | lands                          | applied as          |
|------------------------------|-----------|--------------|--------------------------------|---------------------|
| blocking DiLoCo              | 1         | H            | at once (waits)                | θ ← θ_g             |
| overlapped (`train.overlap`) | 1         | H            | when there, at the latest at 2H | θ ← θ_g + (θ − θ_sent) |
| Streaming DiLoCo (K, τ, α)   | K         | H/K − τ      | at H/K (overlapped: when there) | θ ← lerp(θ_g, θ, α) |

K = 1, τ = 0, α = 0 is blocking DiLoCo, bit for bit. `decide` is the pure rule (what to do after
a step); `Exchanges` owns the fragments' `SyncEngine`s, the worker thread and the one exchange
that may be in flight; the participant (`runner.py`) drives both. See docs/architecture.md.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from fedtrain.config import RunConfig, TransferConfig
from fedtrain.config.privacy import secagg_on
from fedtrain.errors import ModelMismatchError
from fedtrain.participant.client.retry import RetryPolicy
from fedtrain.participant.engine.secagg_pieces import exchange_masked_piece
from fedtrain.participant.engine.secagg_sync import exchange_masked
from fedtrain.participant.engine.sync import SyncEngine
from fedtrain.participant.ranks.control import RankGroup

__all__ = ["Exchanges", "InFlight", "Plan", "decide", "plan_of"]

log = logging.getLogger("fedtrain.participant")

Action = Literal["land", "send", "exchange"]


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


@dataclass(frozen=True)
class Plan:
    """The schedule in force for a round: H/K inner steps, τ, α, the overlapped mode, streaming."""

    steps: int
    tau: int = 0
    alpha: float = 0.0
    overlap: bool = False
    streaming: bool = False

    @classmethod
    def of(cls, config: RunConfig, h: int, k: int) -> Plan:
        s = config.streaming
        if s is None:
            return cls(h, overlap=config.train.overlap)
        return cls(h // k, tau=s.overlap, alpha=s.alpha, overlap=config.train.overlap, streaming=True)


def decide(plan: Plan, steps: int, *, in_flight: bool, ready: bool, may_attempt: bool) -> list[Action]:
    """What to do after an inner step, `steps` into the round (pure; the same on every rank).

    `in_flight`: an exchange has been sent and has not landed; `ready`: it has its answer (on
    every rank); `may_attempt`: no outage backoff is running."""
    if plan.streaming:
        if in_flight:
            if steps < plan.steps or (plan.overlap and not ready):
                return []
            return ["land"]
        if steps >= plan.steps:  # τ = 0, or a send that failed: the whole exchange now
            return ["exchange"] if may_attempt else []
        if plan.tau > 0 and steps >= plan.steps - plan.tau and may_attempt:
            return ["send"]
        return []
    actions: list[Action] = ["land"] if in_flight and ready else []
    if steps >= plan.steps and may_attempt:
        if plan.overlap:
            return ["land", "send"] if in_flight else [*actions, "send"]
        return ["land", "exchange"] if in_flight and not ready else [*actions, "exchange"]
    return actions


@dataclass
class InFlight:
    """An exchange sent and not landed: its round, fragment, the weights its Δ was taken against
    (θ_sent; None on a rank without an engine) and the worker's future (the new version)."""

    round: int
    fragment: int
    sent: dict[str, torch.Tensor] | None
    future: Future[int] | None
    record: dict[str, Any] = field(default_factory=dict)
    bytes_at: tuple[int, int] = (0, 0)  # this rank's bytes up and down when it was sent


class Exchanges:
    """The fragments' engines of one rank (K = 1: the rank's engine itself), and the one exchange
    that may be in flight. A rank that does not speak HTTP (a replicated group's rank > 0) has
    no engine: it keeps the schedule's shape and waits for rank 0."""

    def __init__(self, engine: SyncEngine | None, fragments: list[list[str]] | None,
                 ranks: RankGroup | None = None) -> None:
        self.engine = engine  # the whole sync set's: the join's download, a resync
        self.ranks = ranks  # the ranks' worker channel (`RankGroup.for_worker`): an FSDP group's masked pieces
        self.k = len(fragments) if fragments else 1
        self.streaming = fragments is not None
        if engine is None:
            self.engines: list[SyncEngine] = []
        else:
            self.engines = [engine.fragment(names) for names in fragments] if fragments else [engine]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fedtrain-sync")
        self.pending: InFlight | None = None

    def of(self, r: int) -> int:
        """The fragment round `r` syncs."""
        return r % self.k

    def engine_of(self, r: int) -> SyncEngine | None:
        return self.engines[self.of(r)] if self.engines else None

    @property
    def ready(self) -> bool:
        """Whether the exchange in flight has its answer (a rank without an engine: always)."""
        p = self.pending
        return p is not None and (p.future is None or p.future.done())

    @property
    def bytes_up(self) -> int:
        return sum(e.bytes_up for e in self._counted())

    @property
    def bytes_down(self) -> int:
        return sum(e.bytes_down for e in self._counted())

    def _counted(self) -> list[SyncEngine]:
        engines = list(self.engines)
        if self.engine is not None and self.engine not in engines:
            engines.append(self.engine)
        return engines

    def upload_residual(self) -> dict[str, torch.Tensor]:
        """Every engine's upload residual (the fragments' tensors are disjoint)."""
        out: dict[str, torch.Tensor] = {}
        for e in self._counted():
            out.update(e.upload_residual)
        return out

    def restore_upload_residual(self, tensors: dict[str, torch.Tensor]) -> None:
        """Give each engine its tensors of a saved residual; a name no engine syncs is a
        ModelMismatchError (a checkpoint of another model), and then no engine keeps any."""
        taken: set[str] = set()
        try:
            for e in self._counted():
                taken |= e.restore_upload_residual(tensors)
            unknown = sorted(set(tensors) - taken)
            if unknown:
                raise ModelMismatchError(f"the saved upload residual names tensors this model does not sync: "
                                         f"{', '.join(unknown[:5])}")
        except ModelMismatchError:
            for e in self._counted():
                e.restore_upload_residual({})
            raise

    def send(self, r: int, pid: str, config: RunConfig, *, tokens: int, retry: RetryPolicy | None,
             record: dict[str, Any]) -> None:
        """Take round r's Δ (its fragment's) now and send it on the worker thread; returns at once."""
        if self.pending is not None:
            raise RuntimeError("an exchange is still in flight: land it first")
        engine = self.engine_of(r)
        sent, future = None, None
        at = (self.bytes_up, self.bytes_down)
        if engine is not None:
            sent = engine.copy_sync_set()
            engine.take_delta(sent)
            if secagg_on(config) and engine.piece is not None:  # an FSDP rank: its masked piece (worker channel)
                if self.ranks is None:
                    raise RuntimeError("an FSDP group's masked pieces need the ranks' worker channel")
                future = self._pool.submit(exchange_masked_piece, self.ranks, engine, r, pid, config, tokens=tokens,
                                           retry=retry)
            elif secagg_on(config):  # the masking steps and their waits run on the worker thread too
                future = self._pool.submit(exchange_masked, engine, r, pid, config, tokens=tokens, retry=retry)
            else:
                body = engine.encode(config)
                future = self._pool.submit(engine.exchange, r, pid, body, config, tokens=tokens, retry=retry)
        self.pending = InFlight(r, self.of(r), sent, future, record, at)

    def result(self) -> int | None:
        """Wait for the exchange in flight: the version now in its fragment's snapshot (None on a
        rank without an engine). Its failure is raised; `fail` then puts the reference back."""
        p = self.pending
        if p is None:
            raise RuntimeError("no exchange is in flight")
        return p.future.result() if p.future is not None else None

    def take(self) -> InFlight:
        """The exchange in flight, which has landed (or failed): nothing is in flight after."""
        p = self.pending
        if p is None:
            raise RuntimeError("no exchange is in flight")
        self.pending = None
        return p

    def failed(self, p: InFlight, *, keep_progress: bool) -> None:
        """After the exchange `p` failed: with `keep_progress` (overlapped DiLoCo) θ_sent becomes
        the reference (the round's contribution is lost, the local progress kept); else the
        round's reference comes back and the exchange is tried again whole."""
        engine = self.engines[p.fragment] if self.engines else None
        if engine is None or p.sent is None:
            return
        if keep_progress:
            engine.restore(p.sent)
        else:
            engine.undo_delta(p.sent)

    def take_global(self, pid: str, version: int, have: int | None, *, retry: RetryPolicy | None,
                    transfer: TransferConfig | None = None) -> None:
        """The model takes global version `version` whole. Fragment `have` (just mixed in) is
        already in its snapshot; every other fragment is downloaded (`transfer`: the run's settings)."""
        for p, engine in enumerate(self.engines):
            if p != have:
                engine.download(pid, version=version, retry=retry, transfer=transfer)
            engine.adopt()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
