"""The streamed-safetensors names under the module that used to hold them all.

The code lives by responsibility next to this file: `format` (dtypes, `TensorSpec`, header
validation), `encode` (`EncodedBody`), `reader` (`BodyReader`, `read_tensors`) and `files`
(`write_file`, `iter_file`). Import from `fedtrain.wire`; this module only re-exports, so
that `fedtrain.wire.stream` keeps every name it had.
"""

from __future__ import annotations

from fedtrain.wire.digest import DIGEST_HEADER
from fedtrain.wire.encode import EncodedBody
from fedtrain.wire.files import iter_file, write_file
from fedtrain.wire.format import DTYPE_TO_ST, MAX_HEADER_BYTES, ST_TO_DTYPE, TensorSpec, parse_header, spec_of
from fedtrain.wire.reader import BodyReader, aread_tensors, read_tensors

__all__ = [
    "DIGEST_HEADER",
    "DTYPE_TO_ST",
    "MAX_HEADER_BYTES",
    "ST_TO_DTYPE",
    "BodyReader",
    "EncodedBody",
    "TensorSpec",
    "aread_tensors",
    "iter_file",
    "parse_header",
    "read_tensors",
    "spec_of",
    "write_file",
]
