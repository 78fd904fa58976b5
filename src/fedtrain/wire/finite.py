"""Finding NaN and Inf in a safetensors body while its bytes stream past.

`FiniteScan` is fed the body's chunks in order, as they arrive (after the header is
known), and checks the values of each floating tensor straight from those chunks with
numpy: no copy of the data, no torch call (torch's intra-op threads cost more than the
check on chunks this small), and numpy releases the GIL, so it runs on the spool writer
thread while the event loop receives. An element split between two chunks is put
together from a few carried bytes. A dtype it cannot read (the float8 kinds) makes it
`complete = False`: the caller then checks the values another way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from fedtrain.wire.format import TensorSpec

Check = Callable[[memoryview], bool]


def _float_check(np_dtype: type) -> Check:
    return lambda buf: bool(np.isfinite(np.frombuffer(buf, dtype=np_dtype)).all())


def _bf16_check(buf: memoryview) -> bool:
    bits = np.frombuffer(buf, dtype=np.uint16)
    return not bool(((bits & 0x7F80) == 0x7F80).any())  # exponent all ones: Inf or NaN


_CHECKS: dict[torch.dtype, Check] = {
    torch.float32: _float_check(np.float32),
    torch.float64: _float_check(np.float64),
    torch.float16: _float_check(np.float16),
    torch.bfloat16: _bf16_check,
}


class FiniteScan:
    """Streaming NaN/Inf check of a body laid out as `layout`: (spec, offset of its first
    byte in the body) in body order. `feed` takes the body's bytes from its first on;
    `bad` names the first tensor found with a NaN or Inf."""

    def __init__(self, layout: Sequence[tuple[TensorSpec, int]]) -> None:
        self.complete = True
        self._ranges: list[tuple[int, int, str, Check, int]] = []
        for spec, start in layout:
            if not spec.dtype.is_floating_point or spec.nbytes == 0:
                continue
            check = _CHECKS.get(spec.dtype)
            if check is None:
                self.complete = False
                continue
            self._ranges.append((start, start + spec.nbytes, spec.name, check, spec.dtype.itemsize))
        self.bad: str | None = None
        self._pos = 0
        self._next = 0  # index of the first range not yet fully seen
        self._carry = bytearray()  # the first bytes of an element split between chunks

    def skip(self, n: int) -> None:
        """Step over the body's first `n` bytes without looking at them: its header."""
        if self._ranges and self._pos + n > self._ranges[0][0]:
            raise ValueError("only the bytes before the first value can be skipped")
        self._pos += n

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        mv = memoryview(chunk).cast("B")
        lo, hi = self._pos, self._pos + mv.nbytes
        self._pos = hi
        while self._next < len(self._ranges) and self.bad is None:
            start, end, name, check, size = self._ranges[self._next]
            if start >= hi:
                return
            a, b = max(start, lo), min(end, hi)
            if a < b:
                seg = mv[a - lo : b - lo]
                if self._carry:
                    need = size - len(self._carry)
                    self._carry += seg[:need]
                    seg = seg[need:]
                    if len(self._carry) == size:
                        if not check(memoryview(bytes(self._carry))):
                            self.bad = name
                        self._carry.clear()
                whole = seg.nbytes - seg.nbytes % size
                if whole and not check(seg[:whole]):
                    self.bad = name
                if whole < seg.nbytes:
                    self._carry += seg[whole:]
            if end > hi:
                return
            self._next += 1
