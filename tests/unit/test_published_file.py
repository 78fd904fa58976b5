"""P_r read back from its model file for compressed downloads (`PublishedFile`, #32): the
tensors come back bit for bit, each read fresh when asked for (a fragment's names only); a
file that does not match its version's digest, or whose tensors are not the weights' (name,
dtype, shape), is refused with a StateError, so the merge copies P_r from memory instead;
the file is a reader of the checkpoint directory while it is open."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedtrain.coordinator.model.checkpoints import CheckpointDir
from fedtrain.coordinator.model.published_file import PublishedFile
from fedtrain.errors import StateError
from fedtrain.wire import write_file


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"b.weight": torch.randn(7, 5, generator=g), "a.bias": torch.randn(5, generator=g),
            "c": torch.randn(3, 2, 4, generator=g)}


def _written(tmp_path: Path) -> tuple[CheckpointDir, dict[str, torch.Tensor], str]:
    ckpt = CheckpointDir(tmp_path)
    weights = _weights()
    return ckpt, weights, write_file(ckpt.global_path(3), weights, {"version": "3"})


@pytest.mark.parametrize("names", [None, ["c", "a.bias"]], ids=["all", "fragment"])
def test_the_tensors_come_back_bit_for_bit_one_at_a_time(tmp_path: Path, names: list[str] | None) -> None:
    ckpt, weights, digest = _written(tmp_path)
    kept = PublishedFile(ckpt, 3, digest, weights, names)
    try:
        assert ckpt.open_readers == 1
        assert set(kept) == set(names or weights) and len(kept) == len(names or weights)
        for name in kept:
            got = kept[name]
            assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), weights[name].view(torch.int32))
            assert got.data_ptr() != kept[name].data_ptr()  # read fresh: nothing is held between reads
        if names is not None:
            with pytest.raises(KeyError):
                kept["b.weight"]
    finally:
        kept.close()
    assert ckpt.open_readers == 0


def test_a_file_that_does_not_match_the_digest_is_refused(tmp_path: Path) -> None:
    ckpt, weights, digest = _written(tmp_path)
    path = ckpt.global_path(3)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(StateError, match="digest"):
        PublishedFile(ckpt, 3, digest, weights, None)
    assert ckpt.open_readers == 0


@pytest.mark.parametrize("other", [
    {"a.bias": torch.zeros(6)},  # another shape
    {"a.bias": torch.zeros(5, dtype=torch.float64)},  # another dtype
    {"d": torch.zeros(2)},  # a tensor the file does not hold
], ids=["shape", "dtype", "name"])
def test_a_file_that_is_not_the_weights_is_refused(tmp_path: Path, other: dict[str, torch.Tensor]) -> None:
    ckpt, weights, digest = _written(tmp_path)
    with pytest.raises(StateError, match="does not hold"):
        PublishedFile(ckpt, 3, digest, {**weights, **other}, None)
    assert ckpt.open_readers == 0


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    ckpt, weights, digest = _written(tmp_path)
    with pytest.raises(StateError):
        PublishedFile(ckpt, 4, digest, weights, None)
