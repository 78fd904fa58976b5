"""Compressed pseudo-gradients on the wire: bf16, int8 and e3m0 with per-block scales, and topk.

A compressed body is an ordinary safetensors body whose metadata names its `Codec`: the key
`fedtrain.compression` names the scheme and the others its parameters, so the receiver knows
what it reads before any tensor byte arrives, and `expected_specs` gives the exact header it
must insist on. Every floating tensor `name` travels as (other tensors travel as they are):

- `bf16`: `name` in bfloat16.
- `int8`: `name::scale` (fp32, one absmax/127 scale per `block` values of the flattened
  tensor), then `name` (int8, the original shape).
- `e3m0`: `name::scale` (fp32, one absmax scale per `block` values), then `name` (uint8, two
  4-bit codes a byte: Streaming DiLoCo's sign + 3-bit exponent float, `sparse.py`).
- `int2`: as e3m0 with four 2-bit codes a byte, each one of (-1, -1/3, 1/3, 1) times the scale.
- `int1`: as e3m0 with eight 1-bit codes a byte (the sign), -1 or 1 times the block's mean |value|.
- `ternary`: as e3m0 with five codes a byte in base 3, each -1, 0 or 1 times the block's scale
  (the mean |value| of those over 0.7 times the block's mean |value|; the rest are 0).
- `topk`: `name::scale` (fp32 [chunks, 2]), `name::idx` (uint16 offsets inside each chunk,
  strictly increasing), then `name` (uint8, `bits`-bit codes packed): the `k` largest |values|
  of each `chunk` values (`sparse.py`).

`decompress` turns a body back into full tensors; `decode_parts` leaves a topk tensor sparse
(flat positions and values), for a fold into a running sum that never densifies it. Both
check every scale, offset and code they read, and raise WireError (a 4xx) for a bad one.

`ErrorFeedback` keeps, on the sender, what compression dropped last time and adds it to
the next pseudo-gradient (Seide et al. 2014; Karimireddy et al. 2019), so the error does
not accumulate over rounds.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedtrain.errors import WireError
from fedtrain.wire import sparse

SCHEMES = ("none", "bf16", "int8", "e3m0", "int2", "int1", "ternary", "topk")
#: The schemes whose values are a block scale and packed codes (`sparse.block_quantize`).
BLOCK_SCHEMES = ("e3m0", "int2", "int1", "ternary")
META_KEY = "fedtrain.compression"
BLOCK_KEY = "fedtrain.block"
TOPK_KEY = "fedtrain.topk"  # entries sent per full chunk
CHUNK_KEY = "fedtrain.chunk"
BITS_KEY = "fedtrain.bits"
ENTROPY_KEY = "fedtrain.entropy"  # "deflate": a block codec's scales and packed codes travel deflated (zlib)
ENTROPY_CODERS = ("none", "deflate")
SCALE_KEY = "fedtrain.scale"  # "bf16": a block codec's scales travel in bfloat16 (the codes made against them)
SCALE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: zlib's level for deflated codes: its default, a few percent fewer bytes than level 1 at twice the time.
DEFLATE_LEVEL = 6
SCALE_SUFFIX = "::scale"
INDEX_SUFFIX = "::idx"
DEFAULT_BLOCK = 256
DEFAULT_CHUNK = 4096
DEFAULT_K = 41  # 1% of a chunk of 4096
TOPK_BITS = (2, 4)
#: The most characters a numeric compression parameter may have in the metadata.
_MAX_DIGITS = 9

Spec = tuple[torch.dtype, tuple[int, ...]]


@dataclass(frozen=True)
class Codec:
    """A compression scheme and its parameters, as a body's metadata carries them."""

    scheme: str = "none"
    block: int = DEFAULT_BLOCK  # values per int8 / e3m0 scale
    k: int = DEFAULT_K  # topk: entries sent per full chunk
    chunk: int = DEFAULT_CHUNK  # topk: values per chunk (offsets are uint16)
    bits: int = 2  # topk: bits per value sent
    deflate: bool = False  # a block codec's scales and packed codes deflated (lossless; `ENTROPY_KEY`)
    bf16_scales: bool = False  # a block codec's scales in bfloat16 (`SCALE_KEY`)

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise WireError(f"unknown compression {self.scheme!r}; use one of {', '.join(SCHEMES)}")
        if self.deflate and self.scheme not in BLOCK_SCHEMES:
            raise WireError(f"deflated codes are for the block codecs ({', '.join(BLOCK_SCHEMES)}), not "
                            f"{self.scheme}")
        if self.bf16_scales and self.scheme not in BLOCK_SCHEMES:
            raise WireError(f"bf16 scales are for the block codecs ({', '.join(BLOCK_SCHEMES)}), not {self.scheme}")

        if self.block < 1:
            raise WireError(f"compression block must be at least 1, got {self.block}")
        if self.scheme == "topk":
            if not sparse.MIN_CHUNK <= self.chunk <= sparse.MAX_CHUNK:
                raise WireError(f"topk chunk must be {sparse.MIN_CHUNK} to {sparse.MAX_CHUNK}, got {self.chunk}")
            most = sparse.ceil_div(self.chunk, 4)  # a density of at most 25%: what decoding holds is bounded
            if not 1 <= self.k <= most:
                raise WireError(f"topk entries per chunk must be 1 to a quarter of the chunk ({most}), got {self.k}")
            if self.bits not in TOPK_BITS:
                raise WireError(f"topk bits must be 2 or 4, got {self.bits}")

    @property
    def sparse(self) -> bool:
        return self.scheme == "topk"

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16_scales else torch.float32

    def metadata(self) -> dict[str, str]:
        meta = {META_KEY: self.scheme, BLOCK_KEY: str(self.block)}
        if self.deflate:
            meta[ENTROPY_KEY] = "deflate"
        if self.bf16_scales:
            meta[SCALE_KEY] = "bf16"
        if self.sparse:
            meta.update({TOPK_KEY: str(self.k), CHUNK_KEY: str(self.chunk), BITS_KEY: str(self.bits)})
        return meta

    @classmethod
    def of(cls, metadata: Mapping[str, str]) -> Codec:
        """The codec a body's metadata names (none when it names none); WireError if it is bad."""
        scheme = metadata.get(META_KEY, "none")
        block = _int(metadata, BLOCK_KEY, DEFAULT_BLOCK)
        entropy = metadata.get(ENTROPY_KEY, "none")
        if entropy not in ENTROPY_CODERS:
            raise WireError(f"metadata {ENTROPY_KEY} must be one of {', '.join(ENTROPY_CODERS)}, got {entropy[:40]!r}")
        scale = metadata.get(SCALE_KEY, "fp32")
        if scale not in SCALE_DTYPES:
            raise WireError(f"metadata {SCALE_KEY} must be one of {', '.join(SCALE_DTYPES)}, got {scale[:40]!r}")
        if scheme != "topk":
            return cls(scheme, block, deflate=entropy == "deflate", bf16_scales=scale == "bf16")
        if entropy != "none" or scale != "fp32":
            raise WireError(f"deflated codes and bf16 scales are for the block codecs ({', '.join(BLOCK_SCHEMES)}), "
                            "not topk")
        return cls(scheme, block, _int(metadata, TOPK_KEY, None), _int(metadata, CHUNK_KEY, None),
                   _int(metadata, BITS_KEY, None))

    @classmethod
    def block_codec(cls, train: Any, scheme: str) -> Codec:
        """A run config's codec of a non-topk `scheme` (uploads' or downloads'): its block, and
        deflated codes and bf16 scales where the scheme is a block codec and `train` asks."""
        block = scheme in BLOCK_SCHEMES
        return cls(scheme, train.compression_block, deflate=block and train.entropy_coding == "deflate",
                   bf16_scales=block and train.compression_scale == "bf16")

    @classmethod
    def for_train(cls, train: Any) -> Codec:
        """The codec a run config's `train` section asks for (its fields were validated there)."""
        if train.compression != "topk":
            return cls.block_codec(train, train.compression)
        chunk = train.topk_chunk
        return cls("topk", train.compression_block, max(1, min(chunk, round(train.topk_density * chunk))), chunk,
                   train.topk_bits)


def _int(metadata: Mapping[str, str], key: str, default: int | None) -> int:
    raw = metadata.get(key)
    if raw is None:
        if default is None:
            raise WireError(f"a topk body's metadata must give {key}")
        return default
    if not (isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= _MAX_DIGITS):
        raise WireError(f"metadata {key} is not an integer of at most {_MAX_DIGITS} digits")
    return int(raw)


def _codec(scheme: str | Codec, block: int) -> Codec:
    if isinstance(scheme, Codec):
        return scheme
    if scheme == "topk":  # its header depends on k, chunk and bits: a bare name is not enough
        raise WireError("the topk scheme needs its parameters: pass a Codec")
    return Codec(scheme, block)


def base_name(name: str) -> str:
    """The tensor a body's tensor belongs to: itself, or the one a scale or index part is of."""
    for suffix in (SCALE_SUFFIX, INDEX_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def is_part(name: str) -> bool:
    """Whether a body's tensor is a scale or index part of another."""
    return base_name(name) != name


def parts_of(name: str) -> tuple[str, ...]:
    """Every body key tensor `name` may travel as, in body order."""
    return (name + SCALE_SUFFIX, name + INDEX_SUFFIX, name)


def quantize_int8(t: torch.Tensor, block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values of t's shape, fp32 scales with one per block of the flattened tensor)."""
    flat = t.detach().reshape(-1).float()
    n = flat.numel()
    pad = (-n) % block
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    scales = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(-1)[:n].reshape(t.shape), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    n = q.numel()
    expected = -(-n // block)
    if scales.dim() != 1 or scales.numel() != expected:
        raise WireError(f"int8 tensor of {n} values needs {expected} block scales, got shape {tuple(scales.shape)}")
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise WireError("int8 block scales must be finite and non-negative")
    pad = (-n) % block
    flat = torch.nn.functional.pad(q.reshape(-1).float(), (0, pad)).view(-1, block) * scales[:, None]
    return flat.reshape(-1)[:n].reshape(q.shape)


def compress(delta: Mapping[str, torch.Tensor], scheme: str | Codec, block: int = DEFAULT_BLOCK) -> tuple[
        dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a compressed body for `delta`."""
    codec = _codec(scheme, block)
    meta = codec.metadata()
    if codec.scheme == "none":
        return dict(delta), meta
    out: dict[str, torch.Tensor] = {}
    for name, t in delta.items():
        if not t.is_floating_point():
            out[name] = t
        elif codec.scheme == "bf16":
            out[name] = t.to(torch.bfloat16)
        elif codec.scheme == "int8":
            q, scales = quantize_int8(t, codec.block)
            out[name + SCALE_SUFFIX] = scales
            out[name] = q
        elif codec.scheme in BLOCK_SCHEMES:
            packed, scales = sparse.block_quantize(t, codec.block, codec.scheme, codec.scale_dtype)
            out[name + SCALE_SUFFIX] = deflate(scales.view(torch.uint8)) if codec.deflate else scales
            out[name] = deflate(packed) if codec.deflate else packed
        else:
            scales, offsets, packed = sparse.topk_compress(t, codec.k, codec.chunk, codec.bits)
            out[name + SCALE_SUFFIX] = scales
            out[name + INDEX_SUFFIX] = offsets
            out[name] = packed
    return out, meta


def scheme_of(metadata: Mapping[str, str]) -> tuple[str, int]:
    """(scheme, block) of a body's metadata, every parameter checked (`Codec.of`)."""
    codec = Codec.of(metadata)
    return codec.scheme, codec.block


def codec_of(metadata: Mapping[str, str]) -> Codec:
    return Codec.of(metadata)


def deflate(packed: torch.Tensor) -> torch.Tensor:
    """Bytes (a uint8 tensor: packed codes, or scales viewed as bytes) deflated: a zlib stream,
    as a uint8 tensor."""
    z = zlib.compress(packed.numpy().tobytes(), DEFLATE_LEVEL)
    return torch.frombuffer(bytearray(z), dtype=torch.uint8)


def deflate_bound(n: int) -> int:
    """The most bytes zlib's stream of n bytes may take (zlib's compressBound)."""
    return n + (n >> 12) + (n >> 14) + (n >> 25) + 13


def inflate(z: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """The n bytes of deflated codes or scales `z`; WireError unless it is one whole zlib stream
    of exactly n bytes with nothing after it. Never inflates past n bytes (a stream that would is
    refused)."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(z.numpy().tobytes(), max(n, 1))  # (0 would mean no limit)
    except zlib.error as e:
        raise WireError(f"the deflated codes of {name} are not a zlib stream: {e}") from None
    if len(out) != n or not d.eof or d.unconsumed_tail or d.unused_data:
        raise WireError(f"the deflated codes of {name} must inflate to exactly {n} bytes and end there")
    return torch.frombuffer(bytearray(out), dtype=torch.uint8) if n else torch.zeros(0, dtype=torch.uint8)


def fit_specs(want: Mapping[str, Spec], got: Mapping[str, Spec], codec: Codec) -> dict[str, Spec]:
    """`got` (a body's header) with the shape of each deflated tensor (a block codec's codes or
    scales) taken as `want`'s when it is uint8, flat and within the bound `want` gives (its
    length varies with the values), so that `check_compatible(want, ...)` checks everything
    else exactly."""
    out = dict(got)
    if not codec.deflate:
        return out
    for name, (dtype, shape) in got.items():
        ref = want.get(name)
        if (ref is not None and name[len(base_name(name)):] in ("", SCALE_SUFFIX) and ref[0] == torch.uint8
                and dtype == torch.uint8 and len(shape) == 1 and len(ref[1]) == 1 and 1 <= shape[0] <= ref[1][0]):
            out[name] = ref
    return out


def expected_specs(spec: Mapping[str, Spec], scheme: str | Codec, block: int = DEFAULT_BLOCK) -> dict[str, Spec]:
    """The header a compressed body of a model with `spec` must have, exactly (a deflated codes
    or scales tensor: at most that long, `fit_specs`)."""
    codec = _codec(scheme, block)
    out: dict[str, Spec] = {}
    for name, (dtype, shape) in spec.items():
        numel = 1
        for d in shape:
            numel *= d
        if codec.scheme == "none" or not dtype.is_floating_point:
            out[name] = (dtype, shape)
        elif codec.scheme == "bf16":
            out[name] = (torch.bfloat16, shape)
        elif codec.scheme == "int8":
            out[name + SCALE_SUFFIX] = (torch.float32, (sparse.ceil_div(numel, codec.block),))
            out[name] = (torch.int8, shape)
        elif codec.scheme in BLOCK_SCHEMES:
            scales = sparse.ceil_div(numel, codec.block)
            codes = sparse.block_code_bytes(codec.scheme, numel)
            if codec.deflate:
                out[name + SCALE_SUFFIX] = (torch.uint8, (deflate_bound(scales * codec.scale_dtype.itemsize),))
                out[name] = (torch.uint8, (deflate_bound(codes),))
            else:
                out[name + SCALE_SUFFIX] = (codec.scale_dtype, (scales,))
                out[name] = (torch.uint8, (codes,))
        else:
            chunks = sparse.chunk_counts(numel, codec.k, codec.chunk)[0]
            entries = sparse.topk_entries(numel, codec.k, codec.chunk)
            out[name + SCALE_SUFFIX] = (torch.float32, (chunks, 2))
            out[name + INDEX_SUFFIX] = (torch.uint16, (entries,))
            out[name] = (torch.uint8, (sparse.ceil_div(entries * codec.bits, 8),))
    return out


class _Parts:
    """Gathers the parts of each compressed tensor of a body as they stream past, in body order."""

    def __init__(self, codec: Codec, dtypes: Mapping[str, torch.dtype] | None) -> None:
        self.codec = codec
        self._dtypes = dtypes
        self._held: dict[str, dict[str, torch.Tensor]] = {}

    def take(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Hold a part; the parts of tensor `name` once it (its codes, which come last) arrives,
        or None for a tensor that travels as it is. Raises WireError for a compressed tensor
        whose parts did not come before it."""
        base = base_name(name)
        if base != name:
            self._held.setdefault(base, {})[name[len(base):]] = t
            return None
        parts = self._held.pop(name, None)
        floating = self._dtypes[name].is_floating_point if self._dtypes and name in self._dtypes else None
        if parts is None and self.codec.scheme in ("int8", *BLOCK_SCHEMES, "topk") and (
                floating or (floating is None and t.dtype in (torch.int8, torch.uint8))):
            raise WireError(f"{self.codec.scheme} tensor {name} comes before its scales: a compressed tensor's "
                            "parts come first (scale, then index), then its codes")
        if parts is None:
            return None
        parts[""] = t
        want = {SCALE_SUFFIX, INDEX_SUFFIX, ""} if self.codec.sparse else {SCALE_SUFFIX, ""}
        if set(parts) != want:
            raise WireError(f"{self.codec.scheme} tensor {name} arrives with parts {sorted(parts)}, expected "
                            f"{sorted(want)}")
        return parts

    def finish(self) -> None:
        if self._held:
            raise WireError(f"{self.codec.scheme} scales or indices without their tensors: "
                            f"{', '.join(sorted(self._held)[:10])}")


def _numel(name: str, shapes: Mapping[str, tuple[int, ...]] | None) -> tuple[int, tuple[int, ...]]:
    if shapes is None or name not in shapes:
        raise WireError(f"tensor {name} cannot be decoded without the shape it has in the model")
    shape = tuple(shapes[name])
    n = 1
    for d in shape:
        n *= d
    return n, shape


def decode_parts(tensors: Iterable[tuple[str, torch.Tensor]], metadata: Mapping[str, str],
                 dtypes: Mapping[str, torch.dtype] | None = None,
                 shapes: Mapping[str, tuple[int, ...]] | None = None,
                 ) -> Iterator[tuple[str, torch.Tensor | None, torch.Tensor]]:
    """(name, flat int64 positions, float32 values) of each topk tensor of a body, every part
    checked, never densified; (name, None, full tensor) of every other tensor. One tensor's
    parts are held at a time (a body's parts come in order). `shapes`: the model's (a topk
    or e3m0 body does not carry them)."""
    parts: _Parts | None = None
    for i, (name, t) in enumerate(tensors):
        if i == 0:  # read lazily: a streaming reader fills `metadata` with the header, before any tensor
            parts = _Parts(Codec.of(metadata), dtypes)
        assert parts is not None
        codec = parts.codec
        if codec.scheme == "none":
            yield name, None, t
            continue
        got = parts.take(name, t)
        want = (dtypes or {}).get(name, torch.float32)
        if base_name(name) != name:
            continue
        if got is None:
            yield name, None, (t.to(want) if codec.scheme == "bf16" and t.dtype == torch.bfloat16 else t)
        elif codec.scheme == "int8":
            yield name, None, dequantize_int8(t, got[SCALE_SUFFIX], codec.block).to(want)
        elif codec.scheme in BLOCK_SCHEMES:
            n, shape = _numel(name, shapes)
            scales = got[SCALE_SUFFIX]
            if codec.deflate:
                t = inflate(t, sparse.block_code_bytes(codec.scheme, n), name)
                size = codec.scale_dtype.itemsize
                scales = inflate(scales, sparse.ceil_div(n, codec.block) * size, name + SCALE_SUFFIX).view(
                    codec.scale_dtype)
            values = sparse.block_dequantize(t, scales, n, codec.block, codec.scheme)
            yield name, None, values.reshape(shape).to(want)
        else:
            n, _ = _numel(name, shapes)
            positions, values = sparse.topk_decode(got[SCALE_SUFFIX], got[INDEX_SUFFIX], t, n, codec.k, codec.chunk,
                                                   codec.bits, name)
            yield name, positions, values
    if parts is not None:
        parts.finish()


def decompress(tensors: Iterable[tuple[str, torch.Tensor]], metadata: Mapping[str, str],
               dtypes: Mapping[str, torch.dtype] | None = None,
               shapes: Mapping[str, tuple[int, ...]] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Decode a stream of (name, tensor) of a compressed body back to full tensors, one at a
    time (a tensor's scales and indices are held only until it arrives). `shapes`: the
    model's, for an e3m0 or topk body."""
    for name, positions, values in decode_parts(tensors, metadata, dtypes, shapes):
        if positions is None:
            yield name, values
            continue
        n, shape = _numel(name, shapes)
        want = (dtypes or {}).get(name, torch.float32)
        yield name, sparse.topk_densify(positions, values, n).reshape(shape).to(want)


class ErrorFeedback:
    """Sender-side residual: compress(Δ + β·e), then e ← (Δ + β·e) − decompress(sent). With
    `decay` β = 1 (the default) what was sent plus the residual is always the sum of every Δ
    given, up to float rounding; β < 1 forgets what waits unsent, at β per round (SparseLoCo's
    decayed accumulator, which stands in for the outer momentum)."""

    def __init__(self, decay: float = 1.0) -> None:
        self.residual: dict[str, torch.Tensor] = {}
        self.decay = decay

    def compress(self, delta: Mapping[str, torch.Tensor], scheme: str | Codec, block: int = DEFAULT_BLOCK) -> tuple[
            dict[str, torch.Tensor], dict[str, str]]:
        beta = self.decay
        corrected = {n: torch.add(t, self.residual[n], alpha=beta) if n in self.residual else t
                     for n, t in delta.items()}
        tensors, meta = compress(corrected, scheme, block)
        if _codec(scheme, block).scheme == "none":  # everything is sent: nothing is left over
            self.residual = {}
            return tensors, meta
        dtypes = {n: t.dtype for n, t in corrected.items()}
        shapes = {n: tuple(t.shape) for n, t in corrected.items()}
        for name, at, sent in decode_parts(tensors.items(), meta, dtypes, shapes):
            if not corrected[name].is_floating_point():
                continue
            if at is None:
                self.residual[name] = corrected[name] - sent
                continue
            # topk: what was not sent is Δ + e itself but at the entries sent (no dense decode);
            # Δ + e is a fresh tensor when e was held, else Δ, which is the caller's.
            left = corrected[name] if name in self.residual else corrected[name].clone()
            left = left.contiguous()  # (a fresh tensor may follow the strides of a non-contiguous Δ)
            left.view(-1).index_add_(0, at, sent.to(left.dtype), alpha=-1)
            self.residual[name] = left
        return tensors, meta
