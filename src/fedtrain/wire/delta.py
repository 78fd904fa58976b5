"""Compressed downloads: version r -> r + 1 as a compressed delta, bit-identical on both sides.

The coordinator's outer step turns the published model P_r into G (`merge/outer.py`). What it
publishes is not G but what it sends (server-side error feedback, as SparseLoCo and MuLoCo
keep it on the sender):

    D = (G - P_r) + E_r;   C = codec(D);   P_{r+1} = P_r + decode(C);   E_{r+1} = D - decode(C)

`encode_delta` is the coordinator's half (C, the residual E_{r+1} and P_{r+1}), `apply_delta`
a participant's; both make P_r + decode(C) with the same decode (`compress.decode_parts`, of
the same tensors) and the same add (`_add_decoded`), so the coordinator's weights and every
participant's are the same bits: fp32 on the CPU, tensor by tensor, a topk tensor's entries
added to their positions only (no dense decode, no other op on the other values). The
participant then checks the digest of `target_body` against the version's digest. Pure: no
I/O, no globals.

A delta body is a compressed body (`compress.py`) whose metadata also names what it is a step
between: `FROM_KEY`, `TO_KEY`, the target's digest `DIGEST_KEY` and the target body's own
metadata `META_KEY` (JSON, its keys in their order: the target's digest covers its header).
A Streaming DiLoCo round's delta holds its fragment's tensors only (`apply_delta(partial=True)`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedtrain.errors import WireError
from fedtrain.wire.compress import Codec, compress, decode_parts
from fedtrain.wire.digest import parse_digest
from fedtrain.wire.encode import EncodedBody

__all__ = ["DeltaInfo", "apply_delta", "delta_metadata", "download_codec", "encode_delta", "info_of", "target_body"]

FROM_KEY = "fedtrain.delta.from"
TO_KEY = "fedtrain.delta.to"
DIGEST_KEY = "fedtrain.delta.digest"
META_KEY = "fedtrain.delta.meta"
#: The longest target metadata (JSON) a delta body may carry: the model's own is a few hundred bytes.
MAX_META_CHARS = 1 << 16

TensorDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class DeltaInfo:
    """What a delta body says it is: the step from version `from_version` to `to_version`,
    whose result has digest `digest` as a body with `metadata`."""

    from_version: int
    to_version: int
    digest: str
    metadata: dict[str, str]


def download_codec(train: Any) -> Codec | None:
    """The codec of a run config's compressed downloads (its `train` section, validated
    there), None when downloads go whole. topk takes topk_bits and topk_chunk, and its density
    from download_topk_density (unset: topk_density)."""
    scheme = train.download_compression
    if scheme == "none":
        return None
    if scheme != "topk":
        return Codec.block_codec(train, scheme)
    density = train.download_topk_density if train.download_topk_density is not None else train.topk_density
    chunk = train.topk_chunk
    return Codec("topk", train.compression_block, max(1, min(chunk // 4, round(density * chunk))), chunk,
                 train.topk_bits)


def delta_metadata(codec: Codec, from_version: int, to_version: int, digest: str,
                   target_meta: Mapping[str, str]) -> dict[str, str]:
    """A delta body's metadata: the codec's and what the delta is a step between."""
    return {**codec.metadata(), FROM_KEY: str(from_version), TO_KEY: str(to_version), DIGEST_KEY: digest,
            META_KEY: json.dumps(dict(target_meta), separators=(",", ":"))}


def info_of(metadata: Mapping[str, str]) -> DeltaInfo:
    """The `DeltaInfo` of a delta body's metadata; WireError when a field is missing or bad."""
    try:
        a, b = int(metadata[FROM_KEY]), int(metadata[TO_KEY])
        digest, raw = metadata[DIGEST_KEY], metadata[META_KEY]
    except (KeyError, ValueError):
        raise WireError(f"a delta body's metadata must give {FROM_KEY}, {TO_KEY}, {DIGEST_KEY} and "
                        f"{META_KEY}") from None
    if len(raw) > MAX_META_CHARS:
        raise WireError(f"a delta body's {META_KEY} is longer than {MAX_META_CHARS} characters")
    try:
        meta = json.loads(raw)
    except ValueError:
        raise WireError(f"a delta body's {META_KEY} is not JSON") from None
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise WireError(f"a delta body's {META_KEY} must be a JSON object of strings")
    if b != a + 1 or a < 0:
        raise WireError(f"a delta body must step from one version to the next, not {a} -> {b}")
    return DeltaInfo(a, b, digest, meta)


def _check_prev(prev: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    t = prev.get(name)
    if t is None:
        raise WireError(f"the delta names tensor {name}, which the model it applies to does not hold")
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise WireError(f"tensor {name} must be contiguous float32 on the CPU to take a delta, got {t.dtype} on "
                        f"{t.device}")
    return t


def _add_decoded(name: str, base: torch.Tensor, dest: torch.Tensor, positions: torch.Tensor | None,
                 values: torch.Tensor) -> torch.Tensor:
    """dest = base + the decoded values of tensor `name` (dense, or at `positions`): the one add
    both sides make, fp32 on the CPU (`dest` may be `base`)."""
    if dest is not base:
        dest.copy_(base)
    if positions is None:
        if tuple(values.shape) != tuple(base.shape) or values.dtype != torch.float32:
            raise WireError(f"delta tensor {name} is {tuple(values.shape)} {values.dtype}, the model's "
                            f"{tuple(base.shape)} float32")
        dest.add_(values)
    else:
        flat = dest.view(-1)
        flat.index_put_((positions,), flat[positions] + values)
    return dest


def apply_delta(prev: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str],
                out: Mapping[str, torch.Tensor] | None = None, partial: bool = False) -> TensorDict:
    """P + decode(C), THE one computation of a published model from the one before and a delta
    body's tensors (`tensors`, with `metadata`): per tensor of the body, in its order, a copy of
    P (into `out[name]` when given, which may be P itself) plus the decoded values, fp32 on the
    CPU; a topk tensor's values are added at their positions only. Every tensor of `prev` must
    be in the body, unless `partial` (a Streaming DiLoCo fragment's delta: the others did not
    move). Returns the new tensors in the body's order. WireError for a bad body."""
    dtypes = {n: torch.float32 for n in prev}
    shapes = {n: tuple(t.shape) for n, t in prev.items()}
    result: TensorDict = {}
    for name, positions, values in decode_parts(tensors.items(), metadata, dtypes, shapes):
        base = _check_prev(prev, name)
        dest = out[name] if out is not None and name in out else torch.empty_like(base)
        result[name] = _add_decoded(name, base, dest, positions, values)
    missing = [n for n in prev if n not in result]
    if missing and not partial:
        raise WireError(f"the delta leaves out tensors of the model: {', '.join(missing[:5])}")
    return result


def encode_delta(prev: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor],
                 residual: Mapping[str, torch.Tensor], codec: Codec,
                 ) -> tuple[TensorDict, dict[str, str], TensorDict]:
    """The coordinator's half, one tensor at a time (bounded temporaries): for each tensor of
    `new` (G, the outer step's result from `prev`, P_r), D = (G - P_r) + E (E: `residual`,
    zero where it holds none), C = codec(D); then P_{r+1} = P_r + decode(C) as `apply_delta`
    computes it, written into `new`'s tensors (the master weights, in place), and E_{r+1} =
    D - decode(C), written into `residual`'s tensor where it holds one (so that the old and
    the new residual are never both held whole). Returns (C's tensors, C's codec metadata,
    E_{r+1}). Tensors of `new` missing in `prev` are refused."""
    if codec.scheme == "none":
        raise WireError("a compressed download needs a compression scheme, not none")
    body: TensorDict = {}
    meta = codec.metadata()
    left: TensorDict = {}
    for name, g in new.items():
        p = _check_prev(prev, name)
        d = torch.sub(g, p)
        e = residual.get(name)
        if e is not None:
            d.add_(e)
        part, meta = compress({name: d}, codec)
        body.update(part)
        # decode(C) as a participant decodes the body's bytes (the same checks and arithmetic)
        for _, at, sent in decode_parts(part.items(), meta, {name: torch.float32}, {name: tuple(p.shape)}):
            _add_decoded(name, p, g, at, sent)
            if at is None:
                d.sub_(sent)
            else:
                d.view(-1).index_add_(0, at, sent, alpha=-1)
        if e is not None and e.shape == d.shape and e.dtype == d.dtype:
            left[name] = e.copy_(d)
        else:
            left[name] = d
    return body, meta, left


def target_body(tensors: Mapping[str, torch.Tensor], info: DeltaInfo) -> EncodedBody:
    """The body of the version a delta leads to, over `tensors` (`apply_delta`'s result, in the
    body's order), with the target's metadata and digest algorithm: its `digest()` must be
    `info.digest`, or the participant downloads the model whole."""
    return EncodedBody(tensors, info.metadata, digest_algorithm=parse_digest(info.digest)[0])
