"""The open round's retained updates on disk, for aggregators that need all of them at once.

With the default weighted mean each verified upload is folded into the running sum at
once and its spool file deleted. The coordinate-wise median, the trimmed mean and the
rejection of norm outliers need every update of the round, so the coordinator keeps each
verified spool file here until the round closes, then `aggregate_into` reads them tensor
by tensor (a memory-mapped safetensors file per update, one tensor of each at a time)
and folds the result into the same running sum. Memory stays at k copies of the largest
tensor, whatever the model size; the files live in `state_dir/spool/round-R/` and are
deleted when the round closes or the coordinator restarts (uncommitted work is redone).
"""

from __future__ import annotations

import contextlib
import math
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from fedtrain.config import OuterConfig
from fedtrain.merge import RunningSum
from fedtrain.merge.robust import aggregate_tensor, clip_scale, norm_outliers, sum_of_squares
from fedtrain.wire import iter_file, read_tensors
from fedtrain.wire.compress import SCALE_SUFFIX, decompress


@dataclass(frozen=True)
class SpoolEntry:
    key: str  # the participant id, or "pid@lateR" for a late update from round R
    path: Path
    weight: float  # the fold weight: tokens (or 1) times any staleness discount
    norm: float  # the update's L2 norm over all its tensors


def iter_update(path: Path, dtypes: Mapping[str, torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensors of a verified spool file, one at a time (compressed bodies decoded)."""
    meta: dict[str, str] = {}
    tensors = read_tensors(iter_file(path), on_header=lambda _, m: meta.update(m))
    yield from decompress(tensors, meta, dtypes)


def update_norm_of_file(path: Path, dtypes: Mapping[str, torch.dtype]) -> float:
    """The L2 norm of a spooled update over all its (decoded) tensors."""
    return math.sqrt(sum(sum_of_squares(t) for _, t in iter_update(path, dtypes)))


def _tensor(f: Any, meta: Mapping[str, str], name: str, dtype: torch.dtype) -> torch.Tensor:
    """One decoded tensor of an open safetensors file, read on its own (memory: that tensor)."""
    pieces = [(k, f.get_tensor(k)) for k in (name + SCALE_SUFFIX, name) if k in f.keys()]  # noqa: SIM118
    for _, t in decompress(pieces, meta, {name: dtype}):
        return t
    raise KeyError(name)


class RoundSpool:
    """Retained, verified updates of one open round."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.entries: dict[str, SpoolEntry] = {}

    def keep(self, key: str, verified: Path, round_: int, weight: float, norm: float) -> SpoolEntry:
        """Move a verified spool file into the round's directory and remember it."""
        folder = self.root / f"round-{round_}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{key}.safetensors"
        verified.replace(path)
        entry = SpoolEntry(key, path, weight, norm)
        self.entries[key] = entry
        return entry

    def clear(self) -> None:
        for entry in self.entries.values():
            entry.path.unlink(missing_ok=True)
        self.entries = {}
        for folder in self.root.glob("round-*"):
            shutil.rmtree(folder, ignore_errors=True)

    def aggregate_into(self, acc: RunningSum, outer: OuterConfig, dtypes: Mapping[str, torch.dtype]) -> dict[str, str]:
        """Fold the round's robust aggregate into `acc` (no entries: nothing to do); returns the
        keys left out as norm outliers, each with its reason."""
        if not self.entries:
            return {}
        rejected = norm_outliers({k: e.norm for k, e in self.entries.items()}, outer.outlier_factor)
        kept = [e for k, e in self.entries.items() if k not in rejected]
        if outer.aggregator == "mean":
            for e in kept:
                scale = clip_scale(e.norm, outer.clip_norm)
                for name, tensor in iter_update(e.path, dtypes):
                    acc.fold(name, tensor, e.weight * scale)
                acc.finish_contribution(e.weight)
            return rejected
        scales = [clip_scale(e.norm, outer.clip_norm) for e in kept]
        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(safe_open(str(e.path), framework="pt")) for e in kept]
            metas = [f.metadata() or {} for f in files]
            for name, dtype in dtypes.items():
                stack_k = [_tensor(f, m, name, dtype) * s for f, m, s in zip(files, metas, scales, strict=True)]
                acc.fold(name, aggregate_tensor(stack_k, outer.aggregator, outer.trim_fraction), 1.0)
                del stack_k
        acc.finish_contribution(1.0)
        return rejected
