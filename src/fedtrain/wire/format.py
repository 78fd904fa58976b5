"""The safetensors body format that both sides share: dtypes, tensor specs, the header.

A body is an 8-byte little-endian header length N, N bytes of JSON header (padded with
spaces so the data starts 8-byte aligned), then the tensors' bytes back to back. This module
names that layout (`PREFIX_BYTES`, `MAX_HEADER_BYTES`, the dtype tables), describes a tensor
by its `TensorSpec`, and validates a received header in full with `parse_header`. Nothing
here unpickles: the header is JSON and the data are raw bytes, so a hostile header can at
worst be refused with a `WireError`. A well-formed header nests three levels deep (header,
entry, shape); one nested deeper than `MAX_HEADER_DEPTH` is refused before the JSON parser
sees it, since that parser recurses once per level and a few thousand levels exhaust it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedtrain.errors import WireError

__all__ = [
    "DEFAULT_CHUNK",
    "DTYPE_TO_ST",
    "MAX_HEADER_BYTES",
    "MAX_HEADER_DEPTH",
    "PREFIX_BYTES",
    "ST_TO_DTYPE",
    "TensorSpec",
    "byte_view",
    "parse_header",
    "spec_of",
]

MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself enforces
MAX_HEADER_DEPTH = 8  # header > entry > shape is 3; the rest is room, far below the parser's limit
DEFAULT_CHUNK = 1 << 20
PREFIX_BYTES = 8  # the little-endian u64 header length that starts every body
_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}
# A JSON string (unrolled so that matching is linear), whose brackets are no nesting.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_TO_SQUARE = bytes.maketrans(b"{}", b"[]")

_NAMES = [
    ("F64", "float64"),
    ("F32", "float32"),
    ("F16", "float16"),
    ("BF16", "bfloat16"),
    ("I64", "int64"),
    ("I32", "int32"),
    ("I16", "int16"),
    ("I8", "int8"),
    ("U64", "uint64"),
    ("U32", "uint32"),
    ("U16", "uint16"),
    ("U8", "uint8"),
    ("BOOL", "bool"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
]
ST_TO_DTYPE: dict[str, torch.dtype] = {st: getattr(torch, attr) for st, attr in _NAMES if hasattr(torch, attr)}
DTYPE_TO_ST: dict[torch.dtype, str] = {dtype: st for st, dtype in ST_TO_DTYPE.items()}


#: A body's metadata key naming the rows it holds of each tensor: JSON {name: [start, stop]}, rows
#: along dimension 0; a tensor not named is whole. Pieces of an update and row downloads use it.
ROWS_META = "fedtrain.rows"


@dataclass(frozen=True)
class TensorSpec:
    """What a body says about one tensor: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def spec_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """The specs of a mapping of tensors, in its order."""
    return {name: TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()}


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat writable uint8 memoryview over a contiguous CPU tensor's own storage."""
    # detach() shares storage (and lets .numpy() work on parameters); reshape(-1) of a
    # contiguous tensor is a view, and view(uint8) reinterprets it, bf16 and fp8 included.
    array = t.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)  # type: ignore[arg-type]  # numpy stubs lack __buffer__


def parse_header(raw: bytes) -> tuple[list[TensorSpec], dict[str, str]]:
    """Validate a safetensors JSON header; return the specs in offset order and metadata."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"tensor body header is not valid UTF-8: {exc}") from None
    _check_depth(raw)
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise WireError(f"tensor body header is not valid JSON: {exc}") from None
    except RecursionError:  # _check_depth refuses far less; kept so that no header is ever a 500
        raise WireError("tensor body header is nested too deeply to parse") from None
    if not isinstance(header, dict):
        raise WireError(f"tensor body header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WireError("tensor body '__metadata__' must map strings to strings")
    entries = [(*_parse_entry(name, entry), name) for name, entry in header.items()]
    entries.sort(key=lambda e: (e[1], e[2]))
    expected = 0
    for _spec, begin, end, name in entries:
        if begin != expected:
            what = "gap" if begin > expected else "overlap"
            raise WireError(
                f"tensor body header has a {what}: tensor {name!r} starts at byte "
                f"{begin} of the data but the previous tensor ends at {expected}"
            )
        expected = end
    return [e[0] for e in entries], metadata


def _check_depth(raw: bytes) -> None:
    """Refuse a header whose arrays and objects nest deeper than `MAX_HEADER_DEPTH`.

    Strings are dropped (their brackets are text), then everything but brackets, as "[" and
    "]"; each pass of `replace` removes the innermost pairs, one level, in C. What pairs no
    more is "]]…[[…": its openers are never closed, and nest as deep as there are of them.
    Other unbalanced brackets are left for the JSON parser to name.
    """
    skeleton = _JSON_STRING.sub(b"", raw).translate(_TO_SQUARE, _NOT_BRACKETS)
    for _ in range(MAX_HEADER_DEPTH):
        inner = skeleton.replace(b"[]", b"")
        if inner == skeleton:
            break
        skeleton = inner
    if b"[]" in skeleton or skeleton.count(b"[") > MAX_HEADER_DEPTH:
        raise WireError(
            f"tensor body header nests arrays or objects more than {MAX_HEADER_DEPTH} levels deep; "
            "a safetensors header needs 3"
        )


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise WireError(f"tensor body header names {key!r} twice")
        out[key] = value
    return out


def _parse_entry(name: str, entry: Any) -> tuple[TensorSpec, int, int]:
    if not isinstance(entry, dict) or set(entry) != _ENTRY_FIELDS:
        raise WireError(
            f"tensor body header entry {name!r} must be an object with exactly "
            f"'dtype', 'shape' and 'data_offsets', got {entry!r:.200}"
        )
    dtype = ST_TO_DTYPE.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise WireError(f"tensor {name!r} has unknown dtype {entry['dtype']!r}; supported: {', '.join(ST_TO_DTYPE)}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise WireError(f"tensor {name!r} has invalid shape {shape!r:.200}: expected a list of integers in [0, 2**63)")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise WireError(
            f"tensor {name!r} has invalid data_offsets {offsets!r:.200}: "
            "expected [begin, end] with 0 <= begin <= end < 2**63"
        )
    spec = TensorSpec(name, dtype, tuple(shape))
    begin, end = offsets
    if end - begin != spec.nbytes:
        raise WireError(
            f"tensor {name!r} of {entry['dtype']} {spec.shape} needs {spec.nbytes} "
            f"bytes but its data_offsets {offsets} span {end - begin}"
        )
    return spec, begin, end


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63
