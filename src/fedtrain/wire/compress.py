"""Compressed pseudo-gradients on the wire: bf16, and int8 with one fp32 scale per block.

A compressed body is an ordinary safetensors body. With `int8`, every floating tensor
`name` travels as `name` (int8, the original shape) preceded by `name::scale` (fp32, one
absmax/127 scale per `block` consecutive values of the flattened tensor); other tensors
travel as they are. The metadata key `fedtrain.compression` names the scheme, so the
receiver knows what it reads before any tensor byte arrives, and `expected_specs` says
which header a receiver must insist on.

`ErrorFeedback` keeps, on the sender, what compression dropped last time and adds it to
the next pseudo-gradient (Seide et al. 2014; Karimireddy et al. 2019), so the error does
not accumulate over rounds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from fedtrain.errors import WireError

SCHEMES = ("none", "bf16", "int8")
META_KEY = "fedtrain.compression"
BLOCK_KEY = "fedtrain.block"
SCALE_SUFFIX = "::scale"
DEFAULT_BLOCK = 256

Spec = tuple[torch.dtype, tuple[int, ...]]


def _check(scheme: str, block: int) -> None:
    if scheme not in SCHEMES:
        raise WireError(f"unknown compression {scheme!r}; use one of {', '.join(SCHEMES)}")
    if block < 1:
        raise WireError(f"compression block must be at least 1, got {block}")


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


def compress(delta: Mapping[str, torch.Tensor], scheme: str, block: int = DEFAULT_BLOCK) -> tuple[
        dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a compressed body for `delta`."""
    _check(scheme, block)
    meta = {META_KEY: scheme, BLOCK_KEY: str(block)}
    if scheme == "none":
        return dict(delta), meta
    out: dict[str, torch.Tensor] = {}
    for name, t in delta.items():
        if not t.is_floating_point():
            out[name] = t
        elif scheme == "bf16":
            out[name] = t.to(torch.bfloat16)
        else:
            q, scales = quantize_int8(t, block)
            out[name + SCALE_SUFFIX] = scales
            out[name] = q
    return out, meta


def scheme_of(metadata: Mapping[str, str]) -> tuple[str, int]:
    scheme = metadata.get(META_KEY, "none")
    try:
        block = int(metadata.get(BLOCK_KEY, DEFAULT_BLOCK))
    except ValueError:
        raise WireError(f"metadata {BLOCK_KEY} is not an integer") from None
    _check(scheme, block)
    return scheme, block


def expected_specs(spec: Mapping[str, Spec], scheme: str, block: int = DEFAULT_BLOCK) -> dict[str, Spec]:
    """The header a compressed body of a model with `spec` must have."""
    _check(scheme, block)
    out: dict[str, Spec] = {}
    for name, (dtype, shape) in spec.items():
        if scheme == "none" or not dtype.is_floating_point:
            out[name] = (dtype, shape)
        elif scheme == "bf16":
            out[name] = (torch.bfloat16, shape)
        else:
            numel = 1
            for d in shape:
                numel *= d
            out[name + SCALE_SUFFIX] = (torch.float32, (-(-numel // block),))
            out[name] = (torch.int8, shape)
    return out


def decompress(tensors: Iterable[tuple[str, torch.Tensor]], metadata: Mapping[str, str],
               dtypes: Mapping[str, torch.dtype] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Decode a stream of (name, tensor) of a compressed body back to full tensors, one at a
    time (a scale is held only until its tensor arrives)."""
    scales: dict[str, torch.Tensor] = {}
    scheme, block = "none", DEFAULT_BLOCK
    for i, (name, t) in enumerate(tensors):
        if i == 0:  # read lazily: a streaming reader fills `metadata` with the header, before any tensor
            scheme, block = scheme_of(metadata)
        if scheme == "int8" and name.endswith(SCALE_SUFFIX):
            scales[name[: -len(SCALE_SUFFIX)]] = t
            continue
        want = (dtypes or {}).get(name, torch.float32)
        if scheme == "int8" and t.dtype == torch.int8 and name in scales:
            yield name, dequantize_int8(t, scales.pop(name), block).to(want)
        elif scheme == "bf16" and t.dtype == torch.bfloat16:
            yield name, t.to(want)
        else:
            yield name, t
    if scales:
        raise WireError(f"int8 scales without their tensors: {', '.join(sorted(scales))}")


class ErrorFeedback:
    """Sender-side residual: compress(Δ + e), then e ← (Δ + e) − decompress(sent)."""

    def __init__(self) -> None:
        self.residual: dict[str, torch.Tensor] = {}

    def compress(self, delta: Mapping[str, torch.Tensor], scheme: str, block: int = DEFAULT_BLOCK) -> tuple[
            dict[str, torch.Tensor], dict[str, str]]:
        corrected = {n: t + self.residual[n] if n in self.residual else t for n, t in delta.items()}
        tensors, meta = compress(corrected, scheme, block)
        dtypes = {n: t.dtype for n, t in corrected.items()}
        for name, sent in decompress(tensors.items(), meta, dtypes):
            if corrected[name].is_floating_point():
                self.residual[name] = corrected[name] - sent
        return tensors, meta
