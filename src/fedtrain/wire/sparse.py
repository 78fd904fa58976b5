"""Low-bit and sparse pseudo-gradients: `e3m0` (every value in 4 bits), `int2` and `int1` (every
value in 2 bits, or its sign) and `topk` (the largest entries of each chunk, their values in 2 or 4 bits). Pure tensor
code; `compress.py` puts them in bodies.

e3m0 (Streaming DiLoCo's 4-bit float: a sign bit, three exponent bits, no mantissa): each
value is `scale · 2^(m-7)` for a 3-bit m of 1..7, or 0 for m = 0, with one fp32 absmax scale
per `block` values; two codes a byte, the first in the low nibble. int2: each value is one of
(-1, -1/3, 1/3, 1) times its block's fp32 absmax scale (the nearest), four codes a byte. int1:
the sign, -1 or 1 times its block's mean |value|, eight codes a byte. ternary: -1, 0 or 1 times
its block's scale, five codes a byte in base 3 (1.6 bits a value).

topk: a flat tensor of n values is cut into chunks of `chunk` values (the last one may be
shorter); a chunk of s values sends its `k(s) = max(1, ceil(k·s/chunk))` largest |values|.
Per chunk: the offsets of those entries inside the chunk (uint16, strictly increasing), two
fp32 scales (the smallest and the largest magnitude sent, `lo` and `hi`) and a `bits`-bit
code per entry (sign bit, then the magnitude as one of 2^(bits-1) levels evenly spaced from
lo to hi). Codes are packed flat over the whole tensor, the first in the lowest bits.

Every decode checks what it reads (WireError, a 400): scales finite and ordered, offsets inside
their chunk and strictly increasing (so no duplicate), padding bits zero.
"""

from __future__ import annotations

import math

import torch

from fedtrain.errors import WireError

#: The chunks a topk body may use: offsets are uint16; at most a quarter of a chunk is sent
#: (`Codec`), so decoding holds at most ~5 bytes per value of the tensor (20 per entry).
MIN_CHUNK = 64
MAX_CHUNK = 1 << 16
#: ternary's codes a byte: base 3, the first code the lowest digit (3^5 = 243 <= 256).
TERNARY_PER_BYTE = 5
E3M0_LEVELS = 7  # magnitude codes 1..7 stand for 2^-6 .. 2^0 of the block's scale
_SLICE = 1 << 22  # e3m0 codes are decoded this many at a time (bounded temporaries)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- e3m0 --------------------------------------------------------------------------------------


#: The value of each 4-bit code, before its block's scale: codes 8..15 are the negatives.
E3M0_VALUES = torch.tensor([0.0] + [2.0 ** (m - E3M0_LEVELS) for m in range(1, 8)]
                           + [-0.0] + [-(2.0 ** (m - E3M0_LEVELS)) for m in range(1, 8)])


def _e3m0_code(top10: int) -> int:
    """The code of a float32 of at most 1 in magnitude from its top ten bits (sign, exponent, the
    mantissa's top bit): 2^e · 1.f goes to 2^(e+1) when f's top bit is set (1.f >= 1.5), else
    to 2^e (code e + 7); below 2^-7 (halfway to the smallest level, 2^-6) to 0."""
    sign, e, top = top10 >> 9, ((top10 >> 1) & 0xFF) - 127, top10 & 1
    m = 0 if e < -7 else 1 if e == -7 else min(E3M0_LEVELS, e + E3M0_LEVELS + top)
    return m | (sign << 3)


_E3M0_CODES = torch.tensor([_e3m0_code(i) for i in range(1024)], dtype=torch.uint8)


def _e3m0_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, flat) and absmax scales (in `dtype`) of rows of one block each: each value
    divided by its scale, then its code looked up from its top ten bits (one gather, no float
    math)."""
    scales = _as(x.abs().amax(dim=1), dtype)
    y = x / torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]
    top10 = (y.view(torch.int32) >> 22).bitwise_and_(0x3FF)
    return torch.index_select(_E3M0_CODES, 0, top10.view(-1)), scales


def _as(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 scales as the body sends them (rounded to bf16 for bf16 scales), in fp32: the codes
    are made against the scales the receiver decodes with."""
    return scales if dtype == torch.float32 else scales.to(dtype).float()


def _int2_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, flat) and absmax scales (in `dtype`) of rows of one block each: each value
    divided by its scale goes to the nearest of `INT2_VALUES` (a bf16 scale may round below the
    absmax: the codes clamp)."""
    scales = _as(x.abs().amax(dim=1), dtype)
    y = x / torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]
    return torch.round((y + 1.0) * 1.5).clamp_(0, 3).to(torch.uint8).view(-1), scales


def _ternary_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, flat: 0 for -1, 1 for 0, 2 for +1) and scales of rows of one block each:
    a value whose |value| is over `TERNARY_THRESHOLD` times the block's mean |value| keeps its
    sign, the rest are 0, and the scale is the mean |value| of those kept (Li et al. 2016's
    ternary weights: the scale that best fits the values kept, in L2)."""
    mags = x.abs()
    keep = mags > TERNARY_THRESHOLD * mags.mean(dim=1, keepdim=True)
    kept = keep.sum(dim=1)
    scales = torch.where(keep, mags, 0.0).sum(dim=1) / kept.clamp(min=1)
    codes = torch.where(keep, torch.where(x > 0, 2, 0), 1).to(torch.uint8)
    return codes.view(-1), _as(scales, dtype)


def _int1_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, flat: 1 for a value >= 0, else 0) and the mean |value| of rows of one block
    each: the scaled sign (Karimireddy et al. 2019), whose scale keeps the block's L1 norm."""
    return (x >= 0).to(torch.uint8).view(-1), _as(x.abs().mean(dim=1), dtype)


#: int2 (every value in 2 bits): the value of each code before its block's scale, evenly spaced
#: over [-1, 1] (no zero: the error feedback carries the rounding).
INT2_VALUES = torch.tensor([-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0])
#: int1 (the sign): -1 or 1 times the block's mean |value|.
INT1_VALUES = torch.tensor([-1.0, 1.0])
#: ternary: -1, 0 or 1 times the block's scale, five codes a byte (base 3: 3^5 = 243 <= 256).
TERNARY_VALUES = torch.tensor([-1.0, 0.0, 1.0])
#: ternary keeps a value over this multiple of its block's mean |value| (Li et al. 2016's 0.7).
TERNARY_THRESHOLD = 0.7
#: The block codecs: (codes of rows of one block each, codes per byte, the value of each code).
_BLOCK_CODECS = {"e3m0": (_e3m0_rows, 2, E3M0_VALUES), "int2": (_int2_rows, 4, INT2_VALUES),
                 "int1": (_int1_rows, 8, INT1_VALUES), "ternary": (_ternary_rows, TERNARY_PER_BYTE, TERNARY_VALUES)}


def block_codes_per_byte(scheme: str) -> int:
    """Codes a byte of a block codec (2, 4 or 8 bit-packed; ternary's 5 in base 3)."""
    return _BLOCK_CODECS[scheme][1]


def block_code_bytes(scheme: str, n: int) -> int:
    """The bytes of the packed codes of n values of a block codec."""
    return ceil_div(n, block_codes_per_byte(scheme))


def pack_codes(codes: torch.Tensor, per: int) -> torch.Tensor:
    """`per` codes a byte: bit-packed (2, 4, 8) or base 3 (5, ternary)."""
    return pack_base3(codes) if per == TERNARY_PER_BYTE else pack(codes, 8 // per)


def unpack_codes(packed: torch.Tensor, per: int, n: int) -> torch.Tensor:
    return unpack_base3(packed, n) if per == TERNARY_PER_BYTE else unpack(packed, 8 // per, n)


def block_quantize(t: torch.Tensor, block: int, scheme: str = "e3m0",
                   scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes of the flattened tensor, packed; a scale per block, in `scale_dtype`: fp32,
    or bf16 for half the scales' bytes) of a block codec, a slice of whole blocks at a time
    (bounded temporaries)."""
    rows_of, per, _ = _BLOCK_CODECS[scheme]
    flat = t.detach().reshape(-1).float()
    n = flat.numel()
    full = n // block
    rows = max(1, _SLICE // block)
    codes, scales = [], []
    for r in range(0, full, rows):
        c, sc = rows_of(flat[r * block : min(full, r + rows) * block].view(-1, block), scale_dtype)
        codes.append(c)
        scales.append(sc)
    if n % block:  # the last block, short: its scale is of its own values (int1's mean counts no padding)
        c, sc = rows_of(flat[full * block :].view(1, -1), scale_dtype)
        codes.append(c)
        scales.append(sc)
    if not codes:
        return torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=scale_dtype)
    return pack_codes(torch.cat(codes), per), torch.cat(scales).to(scale_dtype)


def block_dequantize(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int,
                     scheme: str = "e3m0") -> torch.Tensor:
    """The n float32 values of a block codec's codes and their scales; WireError for a bad body."""
    _, per, values = _BLOCK_CODECS[scheme]
    if scales.dim() != 1 or scales.numel() != ceil_div(n, block):
        raise WireError(f"{scheme} values of {n} elements need {ceil_div(n, block)} block scales, got "
                        f"shape {tuple(scales.shape)}")
    check_scales(scales, f"{scheme} block scales")
    codes = unpack_codes(packed, per, n)
    out = torch.empty(ceil_div(n, block) * block, dtype=torch.float32)
    rows = max(1, _SLICE // block)
    padded = torch.nn.functional.pad(codes, (0, out.numel() - n)) if n % block else codes
    for r in range(0, scales.numel(), rows):
        c = padded[r * block : (r + rows) * block]
        view = out[r * block : r * block + c.numel()].view(-1, block)
        torch.index_select(values, 0, c.to(torch.int32), out=view.view(-1))
        view.mul_(scales[r : r + rows].float()[:, None])
    return out[:n]


def e3m0_quantize(t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    return block_quantize(t, block, "e3m0")


def e3m0_dequantize(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int) -> torch.Tensor:
    return block_dequantize(packed, scales, n, block, "e3m0")


# -- topk --------------------------------------------------------------------------------------


def chunk_counts(n: int, k: int, chunk: int) -> tuple[int, int, int]:
    """(chunks, entries sent per full chunk, entries sent by the last chunk) of a tensor of n values."""
    if n == 0:
        return 0, 0, 0
    chunks = ceil_div(n, chunk)
    last = n - (chunks - 1) * chunk
    return chunks, k, max(1, ceil_div(k * last, chunk))


def topk_entries(n: int, k: int, chunk: int) -> int:
    chunks, full, last = chunk_counts(n, k, chunk)
    return (chunks - 1) * full + last if chunks else 0


def topk_compress(t: torch.Tensor, k: int, chunk: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scales [chunks, 2] fp32, offsets uint16, packed codes uint8) of the top-k of each chunk."""
    flat = t.detach().reshape(-1).float()
    n = flat.numel()
    chunks, full_k, last_k = chunk_counts(n, k, chunk)
    if chunks == 0:
        return torch.zeros(0, 2), torch.zeros(0, dtype=torch.uint16), torch.zeros(0, dtype=torch.uint8)
    nfull = n // chunk
    rows: list[tuple[torch.Tensor, int]] = []
    if nfull:
        rows.append((flat[: nfull * chunk].view(nfull, chunk), full_k))
    if n % chunk:
        rows.append((flat[nfull * chunk :].view(1, -1), last_k))
    offsets, values = [], []
    for m, kk in rows:
        _, pos = torch.topk(m.abs(), kk, dim=1, sorted=False)
        pos, _ = pos.sort(dim=1)
        offsets.append(pos.reshape(-1))
        values.append(m.gather(1, pos))
    mags = [v.abs() for v in values]
    scales = torch.cat([torch.stack([g.amin(dim=1), g.amax(dim=1)], dim=1) for g in mags])
    levels = (1 << (bits - 1)) - 1
    codes = []
    for v, g, s in zip(values, mags, _split_scales(scales, [v.shape[0] for v in values]), strict=True):
        span = s[:, 1:] - s[:, :1]
        q = torch.where(span > 0, torch.round((g - s[:, :1]) / torch.where(span > 0, span, 1.0) * levels), 0.0)
        q = q.clamp_(0, levels)
        codes.append((q.to(torch.uint8) | ((v < 0).to(torch.uint8) << (bits - 1))).reshape(-1))
    return scales, torch.cat(offsets).to(torch.uint16), pack(torch.cat(codes), bits)


def _split_scales(scales: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(scales, sizes))


def topk_decode(scales: torch.Tensor, offsets: torch.Tensor, packed: torch.Tensor, n: int, k: int, chunk: int,
                bits: int, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """(flat int64 positions, float32 values) of a topk tensor of n values, every part checked:
    scales finite with 0 <= lo <= hi, each chunk's offsets inside it and strictly increasing
    (no duplicate), padding bits zero. Raises WireError naming `name` otherwise. Memory: about
    20 bytes per entry sent (the positions, the values, the codes), nothing per value not sent."""
    chunks, full_k, last_k = chunk_counts(n, k, chunk)
    entries = topk_entries(n, k, chunk)
    if tuple(scales.shape) != (chunks, 2) or offsets.numel() != entries or offsets.dim() != 1:
        raise WireError(f"{name}: a topk tensor of {n} values in chunks of {chunk} has {chunks} chunks and "
                        f"{entries} entries, got scales {tuple(scales.shape)} and {offsets.numel()} offsets")
    check_scales(scales, f"{name}: topk chunk scales")
    if chunks and bool((scales[:, 0] > scales[:, 1]).any()):
        raise WireError(f"{name}: a topk chunk's smallest magnitude is above its largest")
    positions = offsets.to(torch.int64)  # made flat positions in place, chunk by chunk
    codes = unpack(packed, bits, entries)
    values = torch.empty(entries, dtype=torch.float32)
    nfull = n // chunk
    groups = [(0, nfull, full_k, chunk)] + ([(nfull, 1, last_k, n % chunk)] if n % chunk else [])
    at = 0
    for first, rows, per, size in groups:
        span = slice(at, at + rows * per)
        _decode_rows(positions[span].view(rows, per), codes[span].view(rows, per), scales[first : first + rows],
                     values[span].view(rows, per), first, size, chunk, bits, name)
        at += rows * per
    return positions, values


def _decode_rows(off: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, first: int,
                 size: int, chunk: int, bits: int, name: str) -> None:
    """Check the offsets of `rows` chunks of `size` values (chunk `first` on), write their values
    into `out` and turn the offsets into flat positions, in place."""
    if off.numel() == 0:
        return
    outside = off >= size
    if bool(outside.any()):
        bad = first + int(outside.any(dim=1).nonzero()[0])
        raise WireError(f"{name}: an offset of chunk {bad} is outside it (chunk of {size} values)")
    if off.shape[1] > 1:
        unordered = (off[:, 1:] <= off[:, :-1]).any(dim=1)
        if bool(unordered.any()):
            bad = first + int(unordered.nonzero()[0])
            raise WireError(f"{name}: the offsets of chunk {bad} are not strictly increasing (a duplicate or out "
                            "of order entry)")
    levels = (1 << (bits - 1)) - 1
    lo, hi = scales[:, :1].float(), scales[:, 1:].float()
    mag = (codes & levels).float().div_(levels).mul_(hi - lo).add_(lo)
    torch.where((codes >> (bits - 1)) > 0, -mag, mag, out=out)
    off.add_(torch.arange(first, first + off.shape[0], dtype=torch.int64)[:, None] * chunk)


def topk_densify(positions: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.float32)
    out[positions] = values
    return out


# -- shared ------------------------------------------------------------------------------------


def check_scales(scales: torch.Tensor, what: str) -> None:
    if not scales.is_floating_point() or scales.numel() == 0:
        return
    lo, hi = torch.aminmax(scales)
    if not (math.isfinite(float(lo)) and math.isfinite(float(hi))) or float(lo) < 0:
        raise WireError(f"{what} must be finite and non-negative")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of `bits` bits (2 or 4) packed 8/bits a byte, the first in the lowest bits."""
    per = 8 // bits
    n = codes.numel()
    c = torch.nn.functional.pad(codes.reshape(-1), (0, (-n) % per)).view(-1, per)
    out = c[:, 0].clone()
    for j in range(1, per):
        out |= c[:, j] << (j * bits)
    return out


_BASE3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8)
#: The five base-3 digits of each byte value below 243, a row per byte.
_BASE3_DIGITS = torch.tensor([[(b // 3 ** j) % 3 for j in range(TERNARY_PER_BYTE)] for b in range(243)],
                             dtype=torch.uint8)


def pack_base3(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes of 0..2 packed five a byte, base 3, the first the lowest digit."""
    n = codes.numel()
    c = torch.nn.functional.pad(codes.reshape(-1), (0, (-n) % TERNARY_PER_BYTE)).view(-1, TERNARY_PER_BYTE)
    return (c * _BASE3).sum(dim=1, dtype=torch.uint8)


def unpack_base3(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The n codes of `pack_base3`; WireError for a wrong length, a byte over 242 (no five
    base-3 digits) or padding codes that are not zero."""
    need = ceil_div(n, TERNARY_PER_BYTE)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != need:
        raise WireError(f"{n} ternary codes take {need} bytes, got {tuple(packed.shape)} {packed.dtype}")
    if packed.numel() and int(packed.max()) > 242:
        raise WireError("a ternary code byte is over 242: five base-3 codes a byte go up to 242")
    out = torch.index_select(_BASE3_DIGITS, 0, packed.to(torch.int32)).view(-1)
    if bool(out[n:].any()):
        raise WireError("the padding codes after the last code are not zero")
    return out[:n]


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The n codes of `pack`; WireError for a wrong length or padding bits that are not zero."""
    per = 8 // bits
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != ceil_div(n, per):
        raise WireError(f"{n} codes of {bits} bits take {ceil_div(n, per)} bytes, got {tuple(packed.shape)} "
                        f"{packed.dtype}")
    mask = (1 << bits) - 1
    out = torch.stack([(packed >> (j * bits)) & mask for j in range(per)], dim=1).reshape(-1)
    if bool(out[n:].any()):
        raise WireError("the padding bits after the last code are not zero")
    return out[:n]
