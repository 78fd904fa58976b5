"""The checks of an update's values: NaN, Inf, and magnitudes no outer step can take.

More: docs/architecture.md, "coordinator/intake/values.py".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from fedtrain.errors import Refused
from fedtrain.merge.aggregate import MAX_UPDATE_ABS, max_abs
from fedtrain.wire import TensorSpec

# Codes of refusals of an update's values: each is recorded as an event naming its participant.
POISON_CODES = ("non_finite", "out_of_range", "update_refused")


def non_finite(name: str) -> Refused:
    return Refused(422, "non_finite", f"tensor {name} contains NaN or Inf; the update was refused")


def out_of_range(name: str, value: float) -> Refused:
    return Refused(422, "out_of_range",
                   f"tensor {name} holds a value of magnitude {value:.3g}, more than the {MAX_UPDATE_ABS:.3g} a "
                   "pseudo-gradient may hold (an outer step of it could overflow float32); the update was refused",
                   {"tensor": name, "max_abs": value, "limit": MAX_UPDATE_ABS})


def check_piece(name: str, values: torch.Tensor) -> float:
    """The largest |value| of a piece of an update, or the refusal of the update (422)."""
    m = max_abs(values)
    if not math.isfinite(m):
        raise non_finite(name)
    if m > MAX_UPDATE_ABS:
        raise out_of_range(name, m)
    return m


def flat(t: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A flat view of a tensor's memory: numpy's where numpy has its dtype."""
    view = t.view(-1)
    return view.numpy() if t.dtype in (torch.float32, torch.float64, torch.float16) and t.device.type == "cpu" else view


def _largest(values: np.ndarray | torch.Tensor) -> float:
    """max |value| of a piece (NaN when it holds one): numpy's min and max where it reads the
    dtype (no torch call: on the event loop, torch's intra-op threads cost more than the
    reduction on pieces this small), else torch's."""
    if isinstance(values, torch.Tensor):
        return max_abs(values)
    if values.size == 0:
        return 0.0
    low, high = float(values.min()), float(values.max())
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


class ValueScan:
    """NaN, Inf and the largest |value| of a body received into tensors, looked at as its
    bytes land (still in the CPU's cache), so that counting it needs no pass over them.
    `landed(end)`: the body's bytes [0, end) are in; an element split between two reads is
    looked at once its last byte is."""

    def __init__(self, layout: Sequence[tuple[TensorSpec, int]], targets: dict[str, torch.Tensor]) -> None:
        self._ranges = [(start, start + spec.nbytes, spec.name, flat(targets[spec.name]), spec.dtype.itemsize)
                        for spec, start in layout if spec.dtype.is_floating_point and spec.nbytes]
        self._next = 0
        self._done = 0  # elements looked at of the current tensor
        self.max_abs = 0.0
        self.bad: str | None = None  # the first tensor found with a NaN or Inf
        self.too_large: tuple[str, float] | None = None  # the first tensor with a value beyond MAX_UPDATE_ABS

    def landed(self, end: int) -> None:
        while self._next < len(self._ranges) and self.bad is None:
            start, stop, name, values, size = self._ranges[self._next]
            if end <= start:
                return
            upto = (min(end, stop) - start) // size
            if upto > self._done:
                m = _largest(values[self._done : upto])
                self._done = upto
                if not math.isfinite(m):
                    self.bad = name
                    return
                if m > MAX_UPDATE_ABS and self.too_large is None:
                    self.too_large = (name, m)
                self.max_abs = max(self.max_abs, m)
            if end < stop:
                return
            self._next, self._done = self._next + 1, 0

    def refusal(self) -> Refused | None:
        """The refusal of the body for what the scan found, if anything."""
        if self.bad is not None:
            return non_finite(self.bad)
        if self.too_large is not None:
            return out_of_range(*self.too_large)
        return None
