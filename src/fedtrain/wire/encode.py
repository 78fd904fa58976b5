"""Encoding: a safetensors body over live tensors, yielded as chunks without copying them.

`EncodedBody` builds the header up front and then yields zero-copy views of each tensor's
storage, so a body is never held whole in memory; it is what a participant uploads, what
the coordinator serves, and what `files.write_file` writes to disk. Its digest
("xxh3-128:<hex>" by default, see `digest.py`) travels beside it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import torch

from fedtrain.errors import WireError
from fedtrain.wire.digest import DIGEST_ALGORITHM, StreamingDigest, check_algorithm
from fedtrain.wire.format import DEFAULT_CHUNK, DTYPE_TO_ST, PREFIX_BYTES, ST_TO_DTYPE, byte_view, spec_of

__all__ = ["EncodedBody"]


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise WireError(
                f"body metadata must map strings to strings; got {key!r}: {value!r} ({type(value).__name__})"
            )
        out[key] = value
    return out


class EncodedBody:
    """A safetensors body over live tensors, iterated as chunks without copying them.

    `header` is the first chunk (length prefix and padded JSON); the tensors follow in the
    mapping's order. Iterating again yields the same bytes, so the body can be hashed,
    sent, and re-sent on a retry; the tensors must not change meanwhile. Pass
    `content_length` as the Content-Length header and `digest()` as `DIGEST_HEADER`.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str] | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        digest_algorithm: str | None = None,
    ) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self.digest_algorithm = check_algorithm(digest_algorithm or DIGEST_ALGORITHM)
        self._tensors = dict(tensors)
        self.specs = spec_of(self._tensors)
        self.metadata = _check_metadata(metadata)
        header: dict[str, Any] = {"__metadata__": self.metadata} if self.metadata else {}
        offset = 0
        for name, t in self._tensors.items():
            _check_encodable(name, t)
            end = offset + self.specs[name].nbytes
            header[name] = {
                "dtype": DTYPE_TO_ST[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, end],
            }
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.header: bytes = len(raw).to_bytes(PREFIX_BYTES, "little") + raw
        self.data_length = offset
        self.content_length: int = len(self.header) + offset
        self._digest: str | None = None

    def __iter__(self) -> Iterator[memoryview]:
        step = self.chunk_size
        for _, view in self.segments():
            for start in range(0, view.nbytes, step):
                yield view[start : start + step]

    def segments(self) -> Iterator[tuple[str | None, memoryview]]:
        """The same bytes in larger pieces: the header (named None), then each non-empty
        tensor's whole storage (named), for a writer that wants each tensor at once."""
        yield None, memoryview(self.header)
        for name, t in self._tensors.items():
            if t.numel() == 0:
                continue
            if t.device.type != "cpu" or not t.is_contiguous():
                # One tensor at a time, only when reached: peak extra memory is the
                # largest such tensor, not the body.
                t = t.detach().contiguous().to("cpu")
            yield name, byte_view(t)

    async def aiter_chunks(self) -> AsyncIterator[memoryview]:
        """The same chunks as an async iterator, for `httpx.AsyncClient(content=...)`."""
        for chunk in self:
            yield chunk

    @property
    def known_digest(self) -> str | None:
        """The digest if `digest()` computed it already, else None (nothing is hashed)."""
        return self._digest

    def digest(self) -> str:
        """The body's digest ("<digest_algorithm>:<hex>"), computed by one pass and then cached."""
        if self._digest is None:
            state = StreamingDigest(self.digest_algorithm)
            for chunk in self:
                state.update(chunk)
            self._digest = state.digest()
        return self._digest


def _check_encodable(name: str, t: torch.Tensor) -> None:
    if not isinstance(name, str) or name == "__metadata__":
        raise WireError(f"tensor name {name!r} cannot be used: names must be strings other than '__metadata__'")
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta:
        raise WireError(
            f"tensor {name!r} must be a dense tensor with data, got {type(t).__name__} ({getattr(t, 'layout', '?')})"
        )
    if t.dtype not in DTYPE_TO_ST:
        raise WireError(
            f"tensor {name!r} has dtype {t.dtype}, which safetensors bodies do "
            f"not carry; convert it to one of {sorted(ST_TO_DTYPE)}"
        )
