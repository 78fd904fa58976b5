"""Checking an upload's values for NaN and Inf while its bytes stream past, not afterwards.

`FiniteScan` sees a safetensors body chunk by chunk, in order, on the thread that spools
and hashes it, and reduces each floating tensor's bytes in place with the same fused
`aminmax` as `merge.all_finite` (NaN propagates through min and max, and an Inf is an
extreme). A chunk boundary may fall inside an element; the few bytes before it are carried
to the next chunk, so the scan holds at most one partial element between chunks.

The scan needs the body's layout (`Layout`), known only once the header is parsed; bytes
before the data section are only counted, so a header spread over many chunks is never
read as values.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fedtrain.wire import TensorSpec

__all__ = ["FiniteScan", "Layout", "Span"]

# A chunk is `bytes`, so torch warns that a tensor over it could write to read-only memory.
# These views are only reduced, never written, and dropped before their chunk, so the
# warning says nothing here: it is filtered for this module, and torch's once-per-process
# warning is spent at import, because test runners reset the filters (pytest, per test).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__.replace(".", r"\."))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)

# Float dtypes that aminmax reduces on the CPU; others (float8) are widened per piece.
_REDUCIBLE = {torch.float64, torch.float32, torch.float16, torch.bfloat16}


@dataclass(frozen=True)
class Span:
    """One floating tensor's bytes, as offsets into the whole body (header included)."""

    name: str
    dtype: torch.dtype
    begin: int
    end: int


@dataclass(frozen=True)
class Layout:
    """Where a body's data section starts and which of its byte ranges hold floating values."""

    data_start: int
    spans: tuple[Span, ...]

    @classmethod
    def of(cls, specs: Iterable[TensorSpec], data_start: int) -> Layout:
        """The layout of a body whose tensors, in file order, follow from `data_start` on;
        tensors that are not floating point (e.g. int8 codes) or are empty are left out."""
        spans: list[Span] = []
        offset = data_start
        for spec in specs:
            if spec.dtype.is_floating_point and spec.nbytes:
                spans.append(Span(spec.name, spec.dtype, offset, offset + spec.nbytes))
            offset += spec.nbytes
        return cls(data_start, tuple(spans))


class FiniteScan:
    """Finds the first floating tensor of a streamed body with a NaN or Inf.

    Feed it every chunk of the body in order (`feed`), and its `Layout` (`learn`) before the
    first chunk that reaches the data section. It never raises on bad values: `bad` names the
    first offending tensor, and later bytes are only counted. Not thread-safe: one thread at a
    time, in body order."""

    def __init__(self) -> None:
        self.bad: str | None = None
        self._layout: Layout | None = None
        self._pos = 0  # body offset of the next byte fed
        self._next = 0  # index of the first span not yet fully scanned
        self._carry = bytearray()  # the leading bytes of an element split by a chunk boundary

    def learn(self, layout: Layout) -> None:
        """Set the body's layout; the first one given stands, since a body has one header."""
        if self._layout is not None:
            return
        if self._pos > layout.data_start:  # a bug in the caller, not in the body: say so loudly
            raise RuntimeError(f"{self._pos - layout.data_start} data bytes were fed before the header was known")
        self._layout = layout

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Scan the next bytes of the body."""
        view = memoryview(chunk).cast("B")
        start, end = self._pos, self._pos + view.nbytes
        self._pos = end
        if self._layout is None or self.bad is not None:
            return
        spans = self._layout.spans
        while self._next < len(spans):
            span = spans[self._next]
            lo, hi = max(span.begin, start), min(span.end, end)
            if lo >= hi:  # the span starts after this chunk (earlier ones are done)
                return
            if not self._scan(span, view[lo - start : hi - start]):
                self.bad = span.name
                return
            if hi < span.end:  # the chunk ends inside this tensor
                return
            self._next += 1

    def _scan(self, span: Span, part: memoryview) -> bool:
        size = span.dtype.itemsize
        if self._carry:
            take = min(size - len(self._carry), part.nbytes)
            self._carry += part[:take]
            part = part[take:]
            if len(self._carry) < size:
                return True
            element, self._carry = self._carry, bytearray()
            if not _finite(element, span.dtype):
                return False
        whole = part.nbytes - part.nbytes % size
        self._carry += part[whole:]  # empty at a tensor's end: its length is whole elements
        return whole == 0 or _finite(part[:whole], span.dtype)


def _finite(data: bytes | bytearray | memoryview, dtype: torch.dtype) -> bool:
    """No NaN or Inf among the `dtype` values in `data`, read in place."""
    values = torch.frombuffer(data, dtype=dtype)
    if dtype not in _REDUCIBLE:
        values = values.float()  # float8 widens exactly, NaN and Inf included
    lo, hi = torch.aminmax(values)
    # Python floats, not tensor ops: per chunk, two more small ops would cost more than the scan.
    return math.isfinite(lo.item()) and math.isfinite(hi.item())
