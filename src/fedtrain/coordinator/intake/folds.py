"""The open round's sum, and the updates waiting to go into it.

`RoundSum` owns the running weighted sum and its memory, the fold lock, the reading back of
verified spool files, the updates kept whole for the close, and the round's bookkeeping of
what is in the sum and what waits. Its sum-changing methods run on worker threads under
the fold lock.

More: docs/architecture.md, "coordinator/intake/folds.py".
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fedtrain.config import RunConfig
from fedtrain.coordinator import policy
from fedtrain.coordinator.intake.spool import RoundSpool, Staging
from fedtrain.coordinator.intake.values import ValueScan, check_piece
from fedtrain.errors import MergeError
from fedtrain.merge import RunningSum
from fedtrain.merge.aggregate import MAX_UPDATE_ABS
from fedtrain.merge.robust import norm_outliers, sum_of_squares
from fedtrain.wire import TensorSpec
from fedtrain.wire.compress import scheme_of
from fedtrain.wire.format import ROWS_META

log = logging.getLogger("fedtrain.coordinator")

Spec = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclass(frozen=True)
class Pending:
    """What folding a verified spool file needs besides its weight (`RoundSum.check_and_fold`)."""

    key: str
    may_reach: int  # how many updates the round may end with (`policy.to_fold`)
    max_share: float = 1.0  # outer.max_share of the round's config
    scale: float = 1.0  # clip_norm's factor on the fold weight
    max_abs: float | None = None  # its largest |value|, when known already


@dataclass(frozen=True)
class MergeInputs:
    """What the close needs of the round's updates besides the sum: each one's share of the
    merge, those left out (norm outliers) and those capped, with reasons, and each one's
    largest |value| (to name the update that moves a merge that is not finite)."""

    shares: dict[str, float]
    rejected: dict[str, str]
    capped: dict[str, str]
    largest: dict[str, float]


class RoundSum:
    """The running sum of the open round's updates, and those waiting to go into it."""

    def __init__(self, spool_dir: Path, spec: Spec, params: Mapping[str, torch.Tensor],
                 fold_lock: threading.Lock) -> None:
        self.lock = fold_lock  # held by every fold, by the merge, and by the committer's realign/reconfigure
        self._dtypes = {n: d for n, (d, _) in spec.items()}  # the model's: to decode any body
        self._shapes = {n: tuple(shape) for n, (_, shape) in spec.items()}
        self.storage = {n: torch.zeros(t.shape, dtype=torch.float32, device=t.device) for n, t in params.items()}
        self.acc = RunningSum(params, storage=self.storage)
        self.names: tuple[str, ...] = tuple(self.storage)  # the tensors the open round sums (`select`)
        self.staging = Staging()
        self.kept = RoundSpool(spool_dir)
        self._entries: dict[str, policy.Contribution] = {}
        self._waiting: dict[str, tuple[Path, float]] = {}  # key -> (spool file, clip scale)
        self._barred: dict[tuple[int, str], str] = {}  # (round, participant) -> why its update is refused
        self._freed: queue.SimpleQueue[Path] = queue.SimpleQueue()

    # -- event loop, no fold in flight --------------------------------------------------------------

    def is_empty(self) -> bool:
        return self.acc.count == 0 and not self._entries

    def select(self, names: Sequence[str] | None) -> None:
        """The open round sums `names` only (a Streaming DiLoCo fragment; None: every tensor): a
        sum over their part of `storage`, no memory allocated. At a round boundary, the sum
        empty and no fold in flight; nothing is rebuilt when the tensors are the same."""
        wanted = tuple(self.storage) if names is None else tuple(names)
        if wanted == self.names:
            return
        with self.lock:
            if not self.acc.is_empty or self._entries:
                raise MergeError("the sum still holds updates: the tensors it sums change only at a round boundary")
            part = {n: self.storage[n] for n in wanted}
            self.acc = RunningSum(part, storage=part)
            self.names = wanted

    def fits(self, specs: Mapping[str, TensorSpec]) -> bool:
        """Whether a body of `specs` can be received into the sum's memory as it is."""
        return set(specs) == set(self.names) and all(
            self.storage[n].device.type == "cpu" and specs[n].dtype == self.storage[n].dtype
            and specs[n].shape == tuple(self.storage[n].shape) for n in self.names)

    def barred(self, round_: int, pid: str) -> str | None:
        return self._barred.get((round_, pid))

    def bar(self, round_: int, pid: str, why: str) -> None:
        self._barred[(round_, pid)] = why

    def drain_freed(self) -> list[Path]:
        """Spool files whose updates were folded since last asked (for reuse)."""
        freed = []
        while not self._freed.empty():
            freed.append(self._freed.get_nowait())
        return freed

    def clear(self, committed: bool, oldest_round: int) -> list[Path]:
        """The round is over: kept files go, the bookkeeping empties; returns the spool files of
        waiting updates and folded ones, for reuse. Refusals of rounds before `oldest_round`
        (no late update can come for them) are forgotten once `committed`."""
        if committed:
            for barred in [k for k in self._barred if k[0] < oldest_round]:
                del self._barred[barred]
        self.kept.clear()
        paths = [path for path, _ in self._waiting.values()] + self.drain_freed()
        self._entries.clear()
        self._waiting.clear()
        return paths

    # -- worker threads -----------------------------------------------------------------------------

    def take_direct(self, key: str, weight: float, scan: ValueScan | None) -> None:
        """Count the values written into `storage` as the sum's first contribution, or refuse
        them (422): as `scan` found them as they landed, else checked now."""
        refusal = scan.refusal() if scan is not None else None
        if refusal is not None:
            raise refusal  # not taken: the sum stays empty
        largest = [0.0]

        def check(name: str, values: torch.Tensor) -> None:
            largest[0] = max(largest[0], check_piece(name, values))

        with self.lock:
            if scan is not None:
                self.acc.count_in_place(weight, None, max_abs=scan.max_abs)
                m = scan.max_abs
            else:  # `check` refuses any value beyond MAX_UPDATE_ABS: a bound for the sum
                self.acc.count_in_place(weight, check, max_abs=MAX_UPDATE_ABS)
                m = largest[0]
            self._entries[key] = policy.Contribution(weight, m, folded=True)

    def keep(self, key: str, path: Path, round_: int, weight: float, norm: float, largest: float) -> None:
        """Keep a verified update in its file until the close (a robust aggregator, outliers, a low cap)."""
        with self.lock:
            self.kept.keep(key, path, round_, weight, norm)
            self._entries[key] = policy.Contribution(weight, largest, folded=False)

    def norm(self, path: Path, cfg: RunConfig) -> float:
        """The L2 norm of a verified upload when a rule needs it (clip_norm, outlier_factor), else 0."""
        outer = cfg.outer
        if outer.clip_norm is None and outer.outlier_factor is None:
            return 0.0
        with self.lock:
            return math.sqrt(sum(sum_of_squares(t) for _, _, t, _ in self.spooled(path)))

    def check_and_fold(self, path: Path, weight: float, pending: Pending) -> str | None:
        """Refuse an upload with a NaN or Inf or a value beyond MAX_UPDATE_ABS (422), else fold
        it or let it wait; the sum is left as it was on refusal. Returns why the round cannot
        be merged, if a waiting update's fold failed on the way (else None). The round's
        first update is checked piece by piece as it is written over the (empty) sum, one
        read of the file instead of two, and a refusal undoes it with `reset()`; a later one
        is read once before it is added, for its largest value (and NaN and Inf)."""
        with self.lock:
            largest = pending.max_abs
            if largest is None and not (self.acc.count or self._entries):
                largest = self._fold_first(path, weight * pending.scale, weight)
                self._entries[pending.key] = policy.Contribution(weight, largest, folded=True)
                self._freed.put(path)
                return None
            if largest is None:
                largest = self.check_values(path, locked=True)
            self._entries[pending.key] = policy.Contribution(weight, largest, folded=False)
            self._waiting[pending.key] = (path, pending.scale)
            return self._fold_ready(pending.may_reach, pending.max_share)

    def _fold(self, path: Path, weight: float, scale: float = 1.0, largest: float | None = None) -> None:
        """Fold a verified spool file (under the lock); `scale` < 1 clips the update's norm
        (its weight counts in full). `largest`: its largest |value|, when known."""
        for name, start, values, at in self.spooled(path):
            self._fold_piece(name, start, values, at, weight * scale, largest)
        self.acc.finish_contribution(weight)

    def _fold_piece(self, name: str, start: int, values: torch.Tensor, at: torch.Tensor | None, weight: float,
                    largest: float | None) -> None:
        """Fold one piece of `spooled`: dense values from element `start`, or a topk tensor's
        values at flat positions `at` (added where they belong, never densified)."""
        if at is None:
            self.acc.fold_part(name, start, values, weight, largest)
        else:
            self.acc.fold_sparse(name, at, values, weight, largest)

    def _fold_first(self, path: Path, fold_weight: float, weight: float) -> float:
        """Write the round's first update over the empty sum, checking each piece as it goes;
        its largest |value|. A refusal leaves the sum empty (`reset()`). Under the lock."""
        largest = 0.0
        try:
            for name, start, values, at in self.spooled(path):
                m = check_piece(name, values)
                largest = max(largest, m)
                self._fold_piece(name, start, values, at, fold_weight, m)
            self.acc.finish_contribution(weight)
        except BaseException:
            self.acc.reset()  # it was the only contribution: back to none, exactly
            raise
        return largest

    def _fold_ready(self, may_reach: int, max_share: float) -> str | None:
        """Fold the waiting updates that `policy.to_fold` lets into the sum now. One that fails
        leaves the sum half-folded: returns why the round cannot be merged."""
        for key in policy.to_fold(self._entries, max_share, may_reach):
            path, scale = self._waiting.pop(key)
            entry = self._entries[key]
            try:
                self._fold(path, entry.weight, scale, largest=entry.max_abs)
            except Exception as e:
                log.exception("the fold of a waiting update failed")
                return f"the fold of the accepted update of {key} failed ({e})"
            self._entries[key] = replace(entry, folded=True)
            self._freed.put(path)
        return None

    def spooled(self, path: Path) -> Iterator[tuple[str, int, torch.Tensor, torch.Tensor | None]]:
        """(name, first element, values, flat positions) of a verified spool file: pieces of
        the staging buffer for a plain body (no positions), whole decoded tensors for a
        compressed one, and a topk tensor's sent values with their flat positions (its scales,
        offsets and codes checked as it is decoded: a bad one raises WireError, a 400). The
        caller holds the lock; each piece is valid until the next."""
        metadata = self.staging.header(path)[1]
        if scheme_of(metadata)[0] == "none":
            return ((name, start, values, None) for name, start, values in self.staging.pieces(path))
        parts = self.staging.sparse(path, self._dtypes, metadata, self._shapes_of(metadata))
        return ((name, 0, values, at) for name, at, values in parts)

    def _shapes_of(self, metadata: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
        """The shapes of a verified body's tensors: the model's, or a piece's rows of them (its
        `fedtrain.rows`, checked against the model when it was received)."""
        raw = metadata.get(ROWS_META)
        if raw is None:
            return self._shapes
        rows = {n: (a, b) for n, (a, b) in json.loads(raw).items()}
        return {n: (rows[n][1] - rows[n][0], *shape[1:]) if n in rows else shape for n, shape in self._shapes.items()}

    def check_values(self, path: Path, locked: bool = False) -> float:
        """Refuse a spooled upload with a NaN or Inf anywhere, or a value beyond MAX_UPDATE_ABS
        (one piece in memory at a time, under the lock so concurrent uploads do not multiply
        the memory); its largest |value|."""
        largest = 0.0
        if not locked:
            with self.lock:
                return self.check_values(path, locked=True)
        for name, _, values, _ in self.spooled(path):
            largest = max(largest, check_piece(name, values))
        return largest

    def merge_inputs(self, cfg: RunConfig, failure: str | None) -> MergeInputs:
        """At the close (the caller holds the lock): put the whole round into the sum, the updates
        kept on disk aggregated into it (a robust aggregator, outliers, a low cap), or the
        waiting ones folded with the weights of their capped shares (`policy.closing_weights`).
        Raises MergeError when an accepted update could not be folded (`failure`)."""
        if failure is not None:
            raise MergeError(failure)
        outer, entries = cfg.outer, self.kept.entries
        capped: dict[str, str] = {}
        if entries:
            rejected = norm_outliers({k: e.norm for k, e in entries.items()}, outer.outlier_factor)
            kept = {k: e.weight for k, e in entries.items() if k not in rejected}
            shares: dict[str, float] = {}
            if kept and outer.aggregator != "mean":
                shares = {k: 1.0 / len(kept) for k in kept}
            elif kept:
                shares, capped = policy.cap_shares(kept, outer.max_share)
                for k, share in shares.items():
                    entries[k] = replace(entries[k], weight=share)
            rejected = self.kept.aggregate_into(self.acc, outer, {n: self._dtypes[n] for n in self.names},
                                                self._shapes)
        else:
            rejected = {}
            shares, fold, capped = policy.closing_weights(self._entries, outer.max_share)
            for key, weight in fold.items():
                path, scale = self._waiting.pop(key)
                self._fold(path, weight, scale, largest=self._entries[key].max_abs)
                self._entries[key] = replace(self._entries[key], folded=True)
                self._freed.put(path)
        return MergeInputs(shares, rejected, capped, {k: c.max_abs for k, c in self._entries.items()})
