"""The coordinator's receive path: a body spooled and hashed on a worker thread, verified,
and read back in staged pieces; spool files reused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from fedtrain.coordinator.intake.receive import receive_to_spool
from fedtrain.coordinator.intake.spool import SpoolFiles, Staging
from fedtrain.errors import WireError
from fedtrain.merge import RunningSum
from fedtrain.wire import EncodedBody, StreamingDigest, write_file
from fedtrain.wire.compress import compress
from fedtrain.wire.digest import BackgroundDigest, digest_bytes
from tests.helpers.bodies import chunked


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(300_001, generator=g), "b": torch.randn(7, 5, generator=g), "c": torch.zeros(0)}


def body_bytes(t: dict[str, torch.Tensor], meta: dict[str, str] | None = None,
               algorithm: str | None = None) -> tuple[bytes, str]:
    body = EncodedBody(t, meta, digest_algorithm=algorithm)
    return b"".join(bytes(c) for c in body), body.digest()


def receive(data: bytes, digest: str, path: Path, size: int = 65_536, length: int | None = None,
            on_header=lambda specs, meta: None):
    return asyncio.run(receive_to_spool(chunked(data, size), path, digest=digest,
                                        length=len(data) if length is None else length,
                                        limit=1 << 30, on_header=on_header))[0]


@pytest.mark.parametrize("size", [1, 4097, 65_536, 3 << 20])
def test_received_body_is_spooled_byte_for_byte(tmp_path: Path, size: int) -> None:
    t = tensors()
    data, digest = body_bytes(t)
    if size == 1:
        data, digest = body_bytes({"b": t["b"]})  # one byte at a time: a small body
    reader = receive(data, digest, tmp_path / "u", size)
    assert (tmp_path / "u").read_bytes() == data
    assert reader.done and set(reader.specs or {}) <= set(t)


@pytest.mark.parametrize("algorithm", ["xxh3-128", "sha256"])
def test_either_digest_algorithm_is_accepted(tmp_path: Path, algorithm: str) -> None:
    data, digest = body_bytes(tensors(), algorithm=algorithm)
    assert digest.startswith(algorithm + ":")
    receive(data, digest, tmp_path / "u")
    assert (tmp_path / "u").read_bytes() == data


def test_digest_mismatch_is_refused(tmp_path: Path) -> None:
    data, _ = body_bytes(tensors())
    with pytest.raises(WireError, match="digest mismatch"):
        receive(data, digest_bytes(b"something else"), tmp_path / "u")


def test_corrupted_byte_is_refused(tmp_path: Path) -> None:
    data, digest = body_bytes(tensors())
    bad = bytearray(data)
    bad[-1000] ^= 0x01
    with pytest.raises(WireError, match="digest mismatch"):
        receive(bytes(bad), digest, tmp_path / "u")


def test_truncated_body_is_refused(tmp_path: Path) -> None:
    data, digest = body_bytes(tensors())
    with pytest.raises(WireError, match="truncated"):
        receive(data[:-10], digest, tmp_path / "u", length=len(data))


def test_header_check_runs_before_data(tmp_path: Path) -> None:
    data, digest = body_bytes(tensors())
    seen: list[int] = []

    def refuse(specs: dict, meta: dict) -> None:
        seen.append(len(specs))
        raise WireError("not this model")

    with pytest.raises(WireError, match="not this model"):
        receive(data, digest, tmp_path / "u", on_header=refuse)
    assert seen == [3]


def test_malformed_digest_is_refused_before_reading(tmp_path: Path) -> None:
    data, _ = body_bytes(tensors())
    with pytest.raises(WireError, match="malformed"):
        receive(data, "sha256:xyz", tmp_path / "u")
    assert not (tmp_path / "u").exists()


def test_staging_reads_back_each_tensor_in_pieces(tmp_path: Path) -> None:
    t = tensors(1)
    write_file(tmp_path / "f", t)
    staging = Staging(100_000)  # 25,000 fp32 values per piece: tensor "a" comes in 13 pieces
    got: dict[str, list[torch.Tensor]] = {}
    for name, start, piece in staging.pieces(tmp_path / "f"):
        assert start == sum(p.numel() for p in got.get(name, []))
        assert piece.nbytes <= 100_000
        got.setdefault(name, []).append(piece.clone())
    assert len(got["a"]) == 13 and set(got) == set(t)
    for n in t:
        assert torch.equal(torch.cat(got[n]).view(t[n].shape), t[n])
    whole = {n: v for n, v in staging.tensors(tmp_path / "f")}
    assert all(torch.equal(whole[n], t[n]) for n in t)
    if Path("/proc/self/maps").exists():  # each piece maps the file; a piece let go is unmapped
        def mapped() -> int:
            return Path("/proc/self/maps").read_text().count(str(tmp_path / "f"))
        most = 0
        for _, _, _piece in staging.pieces(tmp_path / "f"):
            most = max(most, mapped())
        del _piece  # held while the next piece is mapped, as a fold loop does
        assert most in (1, 2) and mapped() == 0
    with open(tmp_path / "f", "r+b") as f:  # a file shorter than its header says: an error, never a SIGBUS
        f.truncate(f.seek(0, 2) - 4)
    with pytest.raises(WireError, match="spool file ended inside tensor"):
        list(staging.pieces(tmp_path / "f"))


def test_staging_reads_pieces_through_a_buffer_where_files_cannot_be_mapped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import mmap

    def no_mmap(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(19, "No such device")  # what mmap says on a file system without it

    monkeypatch.setattr("fedtrain.coordinator.intake.spool.mmap.mmap", no_mmap)
    t = tensors(1)
    write_file(tmp_path / "f", t)
    staging = Staging(100_000)
    got: dict[str, list[torch.Tensor]] = {}
    for name, _, piece in staging.pieces(tmp_path / "f"):
        got.setdefault(name, []).append(piece.clone())
    assert len(got["a"]) == 13
    for n in t:
        assert torch.equal(torch.cat(got[n]).view(t[n].shape), t[n])
    assert "cannot be mapped here" in caplog.text


def test_running_sum_folds_pieces_in_order() -> None:
    from fedtrain.errors import MergeError

    t = {"a": torch.randn(10, 3), "b": torch.randn(4)}
    acc = RunningSum(t)
    acc.fold_part("a", 0, t["a"].reshape(-1)[:7], 2.0)
    with pytest.raises(MergeError, match="out of order"):
        acc.fold_part("a", 8, t["a"].reshape(-1)[8:], 2.0)
    with pytest.raises(MergeError, match="incomplete"):
        acc.finish_contribution(2.0)
    acc.fold_part("a", 7, t["a"].reshape(-1)[7:], 2.0)
    acc.fold_part("b", 0, t["b"], 2.0)
    acc.finish_contribution(2.0)
    for n in t:
        torch.testing.assert_close(acc.mean()[n], t[n])


@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_staging_decodes_compressed_bodies(tmp_path: Path, scheme: str) -> None:
    t = {"a": torch.randn(10_000), "b": torch.randn(64, 3)}
    sent, meta = compress(t, scheme)
    write_file(tmp_path / "f", sent, meta)
    staging = Staging()
    got = {n: v.clone() for n, v in staging.decoded(tmp_path / "f", {n: v.dtype for n, v in t.items()})}
    for n in t:
        assert got[n].dtype == torch.float32 and got[n].shape == t[n].shape
        torch.testing.assert_close(got[n], t[n], atol=0.05, rtol=0.02)


def test_background_digest_matches_streaming_digest() -> None:
    chunks = [bytes([i % 251]) * (1000 + 37 * i) for i in range(200)]
    expected = StreamingDigest()
    for c in chunks:
        expected.update(c)
    bg = BackgroundDigest(batch=10_000)
    for c in chunks:
        bg.update(c)
    assert bg.digest() == expected.digest()
    empty = BackgroundDigest()
    assert empty.digest() == digest_bytes(b"")


def test_a_reused_spool_file_holds_exactly_the_new_body(tmp_path: Path) -> None:
    long, long_digest = body_bytes(tensors(0))
    short, short_digest = body_bytes({"b": torch.randn(7, 5)})
    receive(long, long_digest, tmp_path / "u")
    receive(short, short_digest, tmp_path / "u")  # written over the longer one, then cut to size
    assert (tmp_path / "u").read_bytes() == short


def test_spool_files_are_reused_and_a_refused_upload_leaves_the_directory_as_it_was(tmp_path: Path) -> None:
    files = SpoolFiles(tmp_path)
    a, new = files.take()
    assert new
    a.write_bytes(b"x" * 100)
    files.give_back(a)
    assert files.take() == (a, False)  # the same file again: its pages are warm
    files.discard(a, new=False)  # refused: emptied, kept for the next upload
    assert a.read_bytes() == b"" and files.take() == (a, False)
    b, new = files.take()
    b.write_bytes(b"y")
    files.discard(b, new=True)  # refused, and it was new: gone
    assert sorted(p.name for p in tmp_path.iterdir()) == [a.name]


def test_the_participant_client_reads_responses_a_mebibyte_at_a_time() -> None:
    from httpcore._sync.http11 import HTTP11Connection

    from fedtrain.participant.client.coordinator_client import CoordinatorClient
    from fedtrain.transport import http_client

    CoordinatorClient("http://127.0.0.1:9", "t").close()  # a client tunes httpcore when it is created
    assert http_client.tune_httpcore(True)
    assert HTTP11Connection.READ_NUM_BYTES >= http_client.READ_BYTES == 1 << 20


# -- NaN and Inf: refused after the read-back check, and nothing changes ------------------------

# Metadata that puts, in the header, words that read as NaN (fp32: bytes .. .. 80 7f) and as
# Inf (bf16: bytes 80 7f) at aligned offsets: a check that mistook header bytes for data would
# refuse every body that carries it.
