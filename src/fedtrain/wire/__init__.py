"""Tensor bodies on the wire: streamed safetensors and digests, shared by both sides."""

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
from fedtrain.wire.stream import (
    DTYPE_TO_ST,
    MAX_HEADER_BYTES,
    ST_TO_DTYPE,
    BodyReader,
    EncodedBody,
    TensorSpec,
    aread_tensors,
    iter_file,
    parse_header,
    read_tensors,
    spec_of,
    write_file,
)

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
