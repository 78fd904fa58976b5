"""Going back to a kept version: an admin's roll back, or a start past a damaged checkpoint.

Both move the run forward, never back: the open round r is closed with no updates and the
new version r + 1 holds the weights and outer optimizer state of the kept version v (its
files verified on load). History stays monotonic (participants at round r simply find that
it closed and fetch version r + 1), every committed row stays, and the restore is one more
committed round with a reason: "rolled back to version 12 by admin".

More: docs/architecture.md, "coordinator/model/restore.py".
"""

from __future__ import annotations

import time
from typing import Any

from fedtrain.coordinator.model.checkpoints import CheckpointDir
from fedtrain.coordinator.state.store import Store
from fedtrain.errors import MergeError, StateError
from fedtrain.merge import OuterOptimizer


def load_version(ckpt: CheckpointDir, store: Store, version: int) -> OuterOptimizer:
    """The outer optimizer of a kept `version`: its weights and state, both files verified."""
    params = ckpt.load_global(version, store.get_meta(f"digest/{version}"))
    tensors, meta = ckpt.load_outer(version)
    try:
        return OuterOptimizer.restore(params, tensors, meta)
    except MergeError as e:
        raise StateError(f"outer optimizer state of version {version} cannot be restored: {e}") from None


def newest_intact(ckpt: CheckpointDir, store: Store, below: int) -> tuple[int, OuterOptimizer] | None:
    """The newest kept version under `below` whose files both verify, loaded; None if none does."""
    for version in sorted((v for v in ckpt.versions() if v < below), reverse=True):
        try:
            return version, load_version(ckpt, store, version)
        except StateError:
            continue
    return None


def restore_record(r: int, opened_at: float, reason: str, algorithm: str) -> dict[str, Any]:
    """The round row of a restore: round r closed with no updates, for `reason`."""
    return {
        "round": r, "opened_at": opened_at, "closed_at": time.time(), "close_reason": reason,
        "algorithm": algorithm, "n_submissions": 0, "tokens": 0, "bytes_in": 0, "merge_s": 0.0,
    }
