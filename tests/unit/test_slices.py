"""Slices of the global model (`coordinator/slices.py`): from views of the master weights until
they move on, then the rest from the committed file, the same bytes either way, through both send
paths (chunks, the worker-thread pump); a version whose weights moved on before the download
comes from its file, or is gone when its commit failed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedtrain.coordinator.model.checkpoints import CheckpointDir
from fedtrain.coordinator.model.publish import Published, WeightsGuard
from fedtrain.coordinator.model.slices import SliceStream, Wanted, slice_metadata, views
from fedtrain.errors import Refused
from fedtrain.wire import EncodedBody, digest_bytes, write_file
from tests.helpers.bodies import collect, pumped

WANTED: Wanted = {"a": (100_000, 2_900_000), "b": None}


def served(tmp_path: Path) -> tuple[dict[str, torch.Tensor], Published, WeightsGuard, bytes]:
    """Weights published and committed (their file written), and the bytes of their slice."""
    t = {"a": torch.randn(3_000_000), "b": torch.randn(1000), "c": torch.randn(7)}
    body = EncodedBody(t, {"version": "1", "run": "r"})
    guard = WeightsGuard()
    published = Published(1, body.digest(), body, guard.epoch)
    write_file(tmp_path / "g", t, {"version": "1", "run": "r"})
    published.settle(True)
    # The reference: the same rows encoded from a copy of the weights, before any moved.
    copy = {n: v.clone() for n, v in t.items()}
    expected = b"".join(bytes(v) for v in EncodedBody(views(copy, WANTED), slice_metadata(body.metadata, WANTED)))
    return t, published, guard, expected


def from_memory(tmp_path: Path, t: dict[str, torch.Tensor], published: Published, guard: WeightsGuard) -> SliceStream:
    stream = SliceStream(1, WANTED, tmp_path / "g", CheckpointDir(tmp_path), memory=published, guard=guard, params=t)
    stream.prepare()
    return stream


@pytest.mark.parametrize("path", ["chunks", "pump"])
def test_a_slice_goes_on_from_the_file_when_the_weights_move(tmp_path: Path, path: str) -> None:
    t, published, guard, expected = served(tmp_path)
    send = collect if path == "chunks" else pumped
    stream = from_memory(tmp_path, t, published, guard)
    assert stream.memory is published and send(stream) == expected  # from memory: the file's bytes
    moved = []

    def next_outer_step(n: int) -> None:  # a few MB in, the weights change in place
        if n > (2 if path == "chunks" else 3_000_000) and not moved:
            with guard.lock:
                guard.epoch += 1
                t["a"].add_(1.0)
            moved.append(n)

    stream = from_memory(tmp_path, t, published, guard)
    assert send(stream, next_outer_step) == expected  # the rest came from the file, not the changed weights
    assert moved


def test_a_slice_of_weights_moved_on_comes_from_the_file_or_not_at_all(tmp_path: Path) -> None:
    t, published, guard, expected = served(tmp_path)
    stream = SliceStream(1, WANTED, tmp_path / "g", CheckpointDir(tmp_path), memory=published, guard=guard, params=t)
    with guard.lock:
        guard.epoch += 1
        t["a"].add_(1.0)
    stream.prepare()
    assert stream.memory is None and collect(stream) == expected  # committed: from its file

    failed = Published(1, published.digest, published.body, guard.epoch, hold=True)
    failed.settle(False)  # its commit failed, and the run went back
    with guard.lock:
        guard.epoch += 1
    files = CheckpointDir(tmp_path)
    stream = SliceStream(1, WANTED, tmp_path / "g", files, memory=failed, guard=guard, params=t)
    with pytest.raises(Refused) as info:
        stream.prepare()
    assert info.value.status == 404 and files.open_readers == 0


def test_a_slice_whose_weights_move_while_it_is_hashed_comes_from_the_file(tmp_path: Path) -> None:
    """The hash runs without the guard lock: an outer step meanwhile is seen by the epoch after it."""
    t, published, guard, expected = served(tmp_path)
    stream = SliceStream(1, WANTED, tmp_path / "g", CheckpointDir(tmp_path), memory=published, guard=guard, params=t)
    assert stream.body is not None
    hash_views = stream.body.digest

    def step_midway() -> str:
        with guard.lock:
            guard.epoch += 1
            t["a"].add_(1.0)
        return hash_views()  # the digest of weights that were never published

    stream.body.digest = step_midway  # type: ignore[method-assign]
    stream.prepare()
    assert stream.memory is None and collect(stream) == expected
    assert stream.digest == digest_bytes(expected)
