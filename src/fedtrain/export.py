"""`fedtrain export`: the global model as a plain safetensors file, from a coordinator or a state dir."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedtrain.coordinator.checkpoints import CheckpointDir
from fedtrain.coordinator.store import Store
from fedtrain.errors import StateError
from fedtrain.wire import iter_file, read_tensors, write_file


def export_model(args: argparse.Namespace) -> tuple[int, int, str]:
    """Write the chosen global version to args.out; returns (version, tensors, digest)."""
    if args.state_dir is not None:
        version, tensors = _from_state_dir(args.state_dir, args.version)
    else:
        from fedtrain.cli import _token, _verify
        from fedtrain.participant.client import CoordinatorClient, RetryPolicy

        with CoordinatorClient(
            args.coordinator, _token(args), verify=_verify(args), retry=RetryPolicy(max_elapsed_s=10)
        ) as client:
            version, tensors = client.download(version=args.version)
    digest = write_file(args.out, tensors, {"version": str(version), "exported_by": "fedtrain"})
    return version, len(tensors), digest


def _from_state_dir(state_dir: Path, version: int | None) -> tuple[int, dict]:
    db = state_dir / "run.db"
    if not db.is_file():
        raise StateError(f"{state_dir} is not a coordinator state directory (no run.db)")
    store = Store(db)
    try:
        committed = store.committed_version()
        if committed is None:
            raise StateError(f"{state_dir} holds no committed model yet")
        v = committed if version is None else version
        if v > committed:
            raise StateError(f"version {v} is not committed (latest: {committed})")
        digest = store.get_meta(f"digest/{v}")
    finally:
        store.close()
    path = CheckpointDir(state_dir / "checkpoints").global_path(v)
    if not path.is_file():
        raise StateError(f"global model version {v} is no longer kept in {state_dir}")
    return v, dict(read_tensors(iter_file(path), expected_digest=digest))
