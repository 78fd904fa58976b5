"""CheckpointDir: pruned files become spares that the next checkpoint is written over,
never while a download reads them."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from fedtrain.coordinator.model.checkpoints import SPARES, CheckpointDir
from fedtrain.wire import digest_chunks, iter_file


def model(n: int, value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), value), "b": torch.full((3,), value)}


def write(ckpt: CheckpointDir, version: int, n: int, value: float) -> str:
    params = model(n, value)
    return ckpt.write(version, params, {f"momentum_buffer/{k}": v * 2 for k, v in params.items()},
                      {"algorithm": "diloco"}, {"run": "t"}).digest


def spares(ckpt: CheckpointDir) -> list[Path]:
    return sorted(ckpt.root.glob(".spare-*.tmp"))


def test_pruned_files_are_written_over_by_the_next_checkpoint(tmp_path: Path) -> None:
    ckpt = CheckpointDir(tmp_path)
    write(ckpt, 1, 100_000, 1.0)  # a large first model: the spares are longer than what follows
    write(ckpt, 2, 10, 2.0)
    ckpt.prune(2, keep=1)
    assert ckpt.versions() == [2]
    kept = spares(ckpt)
    assert len(kept) == SPARES
    inodes = {p.stat().st_ino for p in kept}

    digest = write(ckpt, 3, 10, 3.0)
    assert not spares(ckpt)  # both taken
    assert {ckpt.global_path(3).stat().st_ino, ckpt.outer_path(3).stat().st_ino} == inodes
    assert digest_chunks(iter_file(ckpt.global_path(3)), digest.split(":")[0]) == digest
    params = ckpt.load_global(3, digest)
    torch.testing.assert_close(params["w"], torch.full((10,), 3.0))
    tensors, meta = ckpt.load_outer(3)
    torch.testing.assert_close(tensors["momentum_buffer/w"], torch.full((10,), 6.0))
    assert meta["algorithm"] == "diloco"


def test_a_file_being_read_is_never_a_spare(tmp_path: Path) -> None:
    ckpt = CheckpointDir(tmp_path)
    write(ckpt, 1, 1000, 1.0)
    before = ckpt.global_path(1).read_bytes()
    reader = ckpt.open_reader(ckpt.global_path(1))
    write(ckpt, 2, 1000, 2.0)
    ckpt.prune(2, keep=1)
    assert not ckpt.global_path(1).exists()
    assert len(spares(ckpt)) == 1  # the outer file only: the model file was unlinked
    write(ckpt, 3, 1000, 3.0)
    write(ckpt, 4, 1000, 4.0)  # spares taken and written over meanwhile
    assert reader.read() == before  # the download still reads version 1's bytes
    ckpt.close_reader(ckpt.global_path(1), reader)

    # once closed, a file is reusable again
    ckpt.prune(4, keep=1)
    assert len(spares(ckpt)) == SPARES


def test_spares_are_removed_at_start_and_a_missing_spare_falls_back(tmp_path: Path) -> None:
    ckpt = CheckpointDir(tmp_path)
    write(ckpt, 1, 100, 1.0)
    write(ckpt, 2, 100, 2.0)
    ckpt.prune(2, keep=1)
    assert spares(ckpt)
    ckpt.remove_temp_files()
    assert not spares(ckpt) and not list(tmp_path.glob("*.tmp*"))
    write(ckpt, 3, 100, 3.0)  # no spare left: fresh files

    ckpt.prune(3, keep=1)
    for p in spares(ckpt):  # deleted behind the coordinator's back
        p.unlink()
    digest = write(ckpt, 4, 100, 4.0)
    torch.testing.assert_close(ckpt.load_global(4, digest)["w"], torch.full((100,), 4.0))


def test_writeback_is_started_window_by_window_and_the_file_is_the_same(tmp_path: Path, monkeypatch) -> None:
    """The sync_file_range hint covers the file in order, once, and changes nothing in it."""
    from fedtrain.wire import files

    tensors = {"a": torch.arange(3_000_000, dtype=torch.float32), "b": torch.ones(700_000)}
    monkeypatch.setattr(files, "sync_file_range", lambda: None)
    reference = files.write_file(tmp_path / "plain.safetensors", tensors)

    calls: list[tuple[int, int]] = []

    def fake(fd: int, offset: int, nbytes: int, flags: int) -> int:
        assert flags == files.SYNC_FILE_RANGE_WRITE
        calls.append((offset, nbytes))
        return 0

    monkeypatch.setattr(files, "sync_file_range", lambda: fake)
    monkeypatch.setattr(files, "WRITEBACK_WINDOW", 4 << 20)
    digest = files.write_file(tmp_path / "hinted.safetensors", tensors)
    assert digest == reference
    assert (tmp_path / "hinted.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
    size = (tmp_path / "hinted.safetensors").stat().st_size
    assert len(calls) >= 3
    assert calls[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(calls))  # contiguous, in order
    assert all(n >= 4 << 20 for _, n in calls)
    assert calls[-1][0] + calls[-1][1] <= size

    refused: list[int] = []
    monkeypatch.setattr(files, "sync_file_range", lambda: lambda fd, o, n, f: refused.append(o) or -1)
    assert files.write_file(tmp_path / "refused.safetensors", tensors) == reference
    assert len(refused) == 1  # a file system without it: asked once, then left to the fsync


def test_sync_file_range_is_found_on_linux() -> None:
    import sys

    from fedtrain.wire import files

    if sys.platform.startswith("linux"):
        assert files.sync_file_range() is not None


def test_a_known_digest_is_taken_and_the_files_are_the_same(tmp_path: Path) -> None:
    """The commit passes the served model's digest: nothing is hashed again, the bytes do not change."""
    from fedtrain.wire import EncodedBody

    hashed, known = CheckpointDir(tmp_path / "hashed"), CheckpointDir(tmp_path / "known")
    params = model(1000, 1.5)
    served = EncodedBody(params, {"run": "t", "version": "1"}).digest()
    outer = {"momentum_buffer/w": params["w"] * 2, "momentum_buffer/b": params["b"] * 2}
    got = hashed.write(1, params, outer, {"algorithm": "diloco"}, {"run": "t"}).digest
    assert got == served  # the served body and the file are the same bytes
    assert known.write(1, params, outer, {"algorithm": "diloco"}, {"run": "t"}, digest="xxh3-128:given").digest == \
        "xxh3-128:given"
    for a, b in ((hashed.global_path(1), known.global_path(1)), (hashed.outer_path(1), known.outer_path(1))):
        assert a.read_bytes() == b.read_bytes()
    torch.testing.assert_close(known.load_global(1, served)["w"], params["w"])
