"""P_r, the published weights an outer step starts from, read back from version r's model file.

Compressed downloads need P_r through the outer step: P_{r+1} = P_r + decode(C) is computed
from it after the step has turned the master weights into G (`wire/delta.py`). Copying P_r
before the step costs one more model in memory for the merge. Version r is committed before
the next merge starts (`Rounds._settle_commit`), and its model file holds exactly the bytes of
its served body, so `PublishedFile` reads P_r from there instead, one tensor at a time, when
`encode_delta` asks for it: the merge holds one tensor of it at a time, never the model.

The file is checked first against the version's digest (read in chunks, hashed, nothing
kept), and its header against the master weights' names, dtypes and shapes; a file that is
missing or does not check out is refused (`StateError`) and the caller copies P_r from memory
instead. The file stays open (a reader of the checkpoint directory: never reused as a spare)
until `close`.
"""

from __future__ import annotations

import io
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO, cast

import torch

from fedtrain.coordinator.model.checkpoints import CheckpointDir
from fedtrain.errors import StateError, WireError
from fedtrain.wire import StreamingDigest
from fedtrain.wire.digest import digests_equal
from fedtrain.wire.format import MAX_HEADER_BYTES, byte_view, parse_header

__all__ = ["PublishedFile"]

_CHUNK = 1 << 22  # bytes hashed at a time: the check holds no more of the file than this


class PublishedFile(Mapping[str, torch.Tensor]):
    """The tensors `names` of version `version`'s model file, each read fresh when asked for
    (`self[name]`: a new fp32 tensor; nothing is cached). `params`: the master weights the file
    must describe (same names, dtypes, shapes)."""

    def __init__(self, ckpt: CheckpointDir, version: int, digest: str, params: Mapping[str, torch.Tensor],
                 names: Collection[str] | None) -> None:
        self._ckpt = ckpt
        self._path: Path = ckpt.global_path(version)
        try:
            self._file: BinaryIO = ckpt.open_reader(self._path)
        except OSError as e:
            raise StateError(f"{self._path} cannot be opened: {e}") from None
        try:
            self._offsets = self._check(digest, params, names)
        except BaseException:
            self.close()
            raise

    def _check(self, digest: str, params: Mapping[str, torch.Tensor], names: Collection[str] | None,
               ) -> dict[str, tuple[int, torch.dtype, tuple[int, ...]]]:
        f = self._file
        state = StreamingDigest.like(digest)
        try:
            while chunk := f.read(_CHUNK):
                state.update(chunk)
            if not digests_equal(state.digest(), digest):
                raise StateError(f"{self._path} does not match the digest of its version")
            f.seek(0)
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= MAX_HEADER_BYTES:
                raise StateError(f"{self._path} has no safetensors header")
            specs, _ = parse_header(f.read(n))
        except (OSError, WireError) as e:
            raise StateError(f"{self._path} cannot be read: {e}") from None
        offsets: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        at = 8 + n
        for spec in specs:  # in offset order, with no gaps (`parse_header` checks it)
            offsets[spec.name] = (at, spec.dtype, spec.shape)
            at += spec.nbytes
        wanted = [name for name in params if names is None or name in names]
        for name in wanted:
            t = params[name]
            if name not in offsets or offsets[name][1:] != (t.dtype, tuple(t.shape)):
                raise StateError(f"{self._path} does not hold tensor {name} as the weights do")
        return {name: offsets[name] for name in wanted}

    def __getitem__(self, name: str) -> torch.Tensor:
        at, dtype, shape = self._offsets[name]  # KeyError for another name, as a Mapping's
        out = torch.empty(shape, dtype=dtype)
        view = byte_view(out)
        self._file.seek(at)
        got = cast(io.BufferedReader, self._file).readinto(view)
        if got != len(view):
            raise StateError(f"{self._path} ended inside tensor {name}")
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._offsets)

    def __len__(self) -> int:
        return len(self._offsets)

    def close(self) -> None:
        f, self._file = self._file, None  # type: ignore[assignment]
        if f is not None:
            self._ckpt.close_reader(self._path, f)
