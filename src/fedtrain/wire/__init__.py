"""Tensor bodies on the wire: streamed safetensors and digests, shared by both sides.

The names below load on first use (see `fedtrain/__init__.py`): the digests need no torch,
so `from fedtrain.wire import DIGEST_HEADER` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedtrain._lazy import lazy_exports as _lazy_exports

_SOURCES = {
    "fedtrain.wire.digest": (
        "DIGEST_ALGORITHM",
        "DIGEST_HEADER",
        "StreamingDigest",
        "digest_bytes",
        "digest_chunks",
        "digests_equal",
        "format_digest",
        "parse_digest",
    ),
    "fedtrain.wire.encode": ("EncodedBody",),
    "fedtrain.wire.files": ("iter_file", "write_file"),
    "fedtrain.wire.format": (
        "DTYPE_TO_ST",
        "MAX_HEADER_BYTES",
        "ST_TO_DTYPE",
        "TensorSpec",
        "parse_header",
        "spec_of",
    ),
    "fedtrain.wire.reader": ("BodyReader", "aread_tensors", "read_tensors"),
}

if TYPE_CHECKING:
    from fedtrain.wire.digest import (
        DIGEST_ALGORITHM,
        DIGEST_HEADER,
        StreamingDigest,
        digest_bytes,
        digest_chunks,
        digests_equal,
        format_digest,
        parse_digest,
    )
    from fedtrain.wire.encode import EncodedBody
    from fedtrain.wire.files import iter_file, write_file
    from fedtrain.wire.format import DTYPE_TO_ST, MAX_HEADER_BYTES, ST_TO_DTYPE, TensorSpec, parse_header, spec_of
    from fedtrain.wire.reader import BodyReader, aread_tensors, read_tensors
else:
    __getattr__, __dir__ = _lazy_exports(__name__, _SOURCES)

__all__ = [
    "DIGEST_ALGORITHM",
    "DIGEST_HEADER",
    "DTYPE_TO_ST",
    "MAX_HEADER_BYTES",
    "ST_TO_DTYPE",
    "BodyReader",
    "EncodedBody",
    "StreamingDigest",
    "TensorSpec",
    "aread_tensors",
    "digest_bytes",
    "digest_chunks",
    "digests_equal",
    "format_digest",
    "iter_file",
    "parse_digest",
    "parse_header",
    "read_tensors",
    "spec_of",
    "write_file",
]
