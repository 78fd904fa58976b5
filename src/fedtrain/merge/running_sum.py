"""`RunningSum`: the coordinator's constant-memory accumulator of Σ wᵢΔᵢ.

Each upload is folded in as it streams (dense, in pieces, or sparse), so memory is one copy of
the sync set whatever the number of contributors, and it cannot overflow for finite inputs
(see the class docstring). `aggregate.weighted_mean` is the naive reference it is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from fedtrain.errors import MergeError
from fedtrain.merge.aggregate import (
    SpecLike,
    TensorDict,
    TensorSpec,
    _check_weight,
    _listed,
    _shape_str,
    _spec,
    check_compatible,
)
from fedtrain.merge.aggregate import max_abs as _largest  # the methods' `max_abs` argument hides the name

__all__ = ["RunningSum"]

# RunningSum keeps a bound on |accumulator| at most this (2**127, half of float32's largest):
# below it no addition of finite terms can round up to Inf.
_SUM_LIMIT = 2.0**127


class RunningSum:
    """Σ wᵢΔᵢ folded in place, one tensor at a time, in a fixed set of accumulators.

    Memory is one copy of the sync set (in `dtype`) whatever the number of contributors.
    Use `fold` (`fold_part`, `fold_sparse`) for each tensor of one update as it streams in,
    then `finish_contribution` once; or `add` for a whole update at hand. `mean()` divides in place and hands out
    the accumulators themselves (`scaled()` hands them out with the divisor, for the outer
    step to divide as it reads); call `reset()` before the next round.

    The accumulators hold Σ wᵢΔᵢ / s, where the scale s is the first contribution's weight:
    the first contribution is written over them as it is, without a multiply (whoever owns
    the memory they live in, `storage`, may write it there itself and `count_in_place`), the
    others are folded with wᵢ / s, and the mean is Σ wᵢΔᵢ / Σ wᵢ = acc · s / Σ wᵢ, one
    multiply that the outer step can fuse and that a single contribution does not need.
    An accumulator holds no value until the first contribution writes over it, and
    `reset()` just marks them all so again: no pass over the memory to zero it. A first
    contribution that fails half way is undone by `reset()` exactly.

    It cannot overflow. It keeps a bound on every accumulator value, Σ (wᵢ / s)·maxᵢ (maxᵢ
    the largest |value| of contribution i, given by a caller that checked it, else read off
    each piece as it is folded), and before a fold would take that bound past 2**127 it
    multiplies the accumulators by a power of two and raises s by as much: exact (a
    power of two changes no significant bit), so Σ wᵢΔᵢ = acc · s holds throughout, and
    the sum of any finite inputs stays finite (two updates of 3e38 average to 3e38, not
    Inf). Honest updates never come near the bound: the rescale pass is for hostile ones.
    The mean it hands out is a weighted mean of finite values, so it is finite too.
    """

    def __init__(self, like: Mapping[str, SpecLike], dtype: torch.dtype = torch.float32,
                 storage: Mapping[str, torch.Tensor] | None = None) -> None:
        if not dtype.is_floating_point:
            raise MergeError(f"accumulator dtype must be floating point, got {dtype}")
        self._specs: dict[str, TensorSpec] = {k: _spec(v) for k, v in like.items()}
        self._acc: TensorDict = {}
        for name, value in like.items():
            if storage is not None:
                self._acc[name] = _owned(storage, name, self._specs[name][1], dtype)
                continue
            device = value.device if isinstance(value, torch.Tensor) else None
            self._acc[name] = torch.zeros(self._specs[name][1], dtype=dtype, device=device)
        self._pending: set[str] = set()
        self._partial: dict[str, int] = {}  # fold_part: elements folded so far of a tensor in progress
        self._fresh: set[str] = set(self._acc)  # accumulators with no value yet: written over, not added to
        self._scale: float | None = None  # the accumulators hold Σ wᵢΔᵢ / _scale; None: not set yet
        self._bound = 0.0  # every |accumulator value| <= this, from the counted contributions
        self._open_max = 0.0  # largest |value| folded so far of the contribution in progress
        self._rescales = 0
        self._total_weight = 0.0
        self._count = 0
        self._averaged = False  # handed out (`scaled` or `mean`): no fold until `reset`
        self._divided = False  # `mean` divided the accumulators in place

    @property
    def total_weight(self) -> float:
        return self._total_weight

    @property
    def count(self) -> int:
        return self._count

    @property
    def bound(self) -> float:
        """An upper bound on every |value| the accumulators hold (in their units, Σ wᵢΔᵢ / s)."""
        return self._bound + (self._alpha_now() * self._open_max if self._open_max else 0.0)

    @property
    def rescales(self) -> int:
        """How often the accumulators were scaled down to keep them finite (since created)."""
        return self._rescales

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._acc.values())

    def _check_open(self) -> None:
        if self._averaged:
            raise MergeError("mean() was already taken from this sum; call reset() before folding")

    def fold(self, name: str, tensor: torch.Tensor, weight: float, max_abs: float | None = None) -> None:
        """Add weight·tensor into the accumulator `name`, in place (dtype is cast). `max_abs`:
        a bound on its |values| (of these or of the whole contribution), from a caller that
        checked them; else their largest is read off them."""
        self._check_open()
        w = _check_weight(weight, f"tensor {name!r}")
        if name not in self._acc:
            raise MergeError(f"unexpected key {name!r}: the model has no tensor of that name")
        acc = self._acc[name]
        if tuple(tensor.shape) != tuple(acc.shape):
            raise MergeError(
                f"shape of {name} is {_shape_str(tuple(tensor.shape))}, expected {_shape_str(tuple(acc.shape))}"
            )
        if not tensor.is_floating_point():
            raise MergeError(f"{name} has dtype {tensor.dtype}; pseudo-gradients must be floating point")
        if name in self._pending:
            raise MergeError(f"{name} was folded twice for one contribution")
        self._make_room(name, tensor, w, max_abs)
        _accumulate(acc, tensor.detach().to(device=acc.device), self._alpha(w), name in self._fresh)
        self._fresh.discard(name)
        self._pending.add(name)

    def fold_part(self, name: str, start: int, values: torch.Tensor, weight: float,
                  max_abs: float | None = None) -> None:
        """Add weight·values into elements [start, start + n) of the flattened accumulator
        `name`: a tensor folded piece by piece, in order (a whole tensor, reshaped, is the
        piece at 0). It counts as folded once its last element is. `max_abs` as for `fold`."""
        self._check_open()
        w = _check_weight(weight, f"tensor {name!r}")
        if name not in self._acc:
            raise MergeError(f"unexpected key {name!r}: the model has no tensor of that name")
        if not values.is_floating_point():
            raise MergeError(f"{name} has dtype {values.dtype}; pseudo-gradients must be floating point")
        flat = self._acc[name].view(-1)
        n = values.numel()
        if name in self._pending or start != self._partial.get(name, 0) or start + n > flat.numel():
            raise MergeError(f"{name}: piece [{start}, {start + n}) is out of order or out of range "
                             f"for {flat.numel()} elements")
        self._make_room(name, values, w, max_abs)
        _accumulate(flat[start : start + n], values.detach().reshape(-1).to(device=flat.device), self._alpha(w),
                    name in self._fresh)
        if start + n == flat.numel():
            self._partial.pop(name, None)
            self._fresh.discard(name)
            self._pending.add(name)
        else:
            self._partial[name] = start + n

    def fold_sparse(self, name: str, positions: torch.Tensor, values: torch.Tensor, weight: float,
                    max_abs: float | None = None) -> None:
        """Add weight·values at flat `positions` (int64, no duplicates) of the accumulator `name`,
        zero elsewhere: a sparse tensor (a topk update's) folded whole, without a dense copy
        of it. `max_abs` as for `fold`."""
        self._check_open()
        w = _check_weight(weight, f"tensor {name!r}")
        if name not in self._acc or name in self._pending or name in self._partial:
            raise MergeError(f"{name!r} is not a tensor of the model, or was folded twice for one contribution")
        if not values.is_floating_point() or positions.dtype != torch.int64 or positions.shape != values.shape:
            raise MergeError(f"{name}: a sparse fold takes int64 positions and floating values of one shape")
        flat = self._acc[name].view(-1)
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= flat.numel()):
            raise MergeError(f"{name}: a position is outside its {flat.numel()} elements")
        self._make_room(name, values, w, max_abs)
        alpha = self._alpha(w)
        if name in self._fresh:
            flat.zero_()  # no value yet: what is not sent is zero
        flat.index_add_(0, positions.to(flat.device), values.detach().to(device=flat.device, dtype=flat.dtype),
                        alpha=alpha)
        self._fresh.discard(name)
        self._pending.add(name)

    def _alpha(self, w: float) -> float:
        """The factor a value folded with weight `w` is multiplied by: w / scale, where the
        sum's first fold sets the scale to its weight (a weight of 0 leaves it at 1)."""
        if self._scale is None:
            self._scale = w if w > 0 else 1.0
        return w / self._scale

    def _alpha_now(self) -> float:
        return 1.0 if self._scale is None else 1.0 / self._scale

    def _make_room(self, name: str, values: torch.Tensor, w: float, max_abs: float | None) -> None:
        """Before a fold of `values` (weight w): note their largest |value| and, should the
        bound on the accumulators pass `_SUM_LIMIT` with them, scale the accumulators down by
        a power of two first. A single contribution needs no room: its values are finite."""
        m = max_abs if max_abs is not None else _largest(values)
        if not math.isfinite(m):
            raise MergeError(f"{name} has NaN or infinite values; it cannot be added to the sum")
        self._open_max = max(self._open_max, m)
        if self._count == 0 or w == 0:
            return
        alpha = w / (self._scale or 1.0)
        need = self._bound + alpha * self._open_max
        if need <= _SUM_LIMIT:
            return
        factor = 2.0 ** -math.ceil(math.log2(need / _SUM_LIMIT) + 1)  # the bound ends at most half the limit
        for key, acc in self._acc.items():
            if key not in self._fresh:
                acc.mul_(factor)
        self._scale = (self._scale or 1.0) / factor
        self._bound *= factor
        self._rescales += 1

    @property
    def is_empty(self) -> bool:
        """No contribution is in the sum, counted or in progress (its accumulators hold no value)."""
        return not (self._count or self._pending or self._partial)

    def peek(self) -> TensorDict:
        """The accumulators as they are (Σ wᵢΔᵢ / s, see the class), for inspection: not to change."""
        return dict(self._acc)

    def count_in_place(self, weight: float, check: Callable[[str, torch.Tensor], None] | None = None,
                       piece: int = 1 << 22, max_abs: float | None = None) -> None:
        """Count the values the owner of the sum's `storage` wrote into it while the sum was
        empty as its first contribution, with `weight`: each piece of `piece` elements is passed
        to `check` (which may raise); the values stay as they are (the weight becomes the sum's
        scale), bit for bit what folding them would give. `max_abs`: their largest |value|,
        when the writer saw it (else each piece's is read off it). If anything raises the sum
        is left empty."""
        self._check_open()
        w = _check_weight(weight, "contribution")
        if self._count or self._pending or self._partial:
            raise MergeError("the sum already holds a contribution: fold into it instead")
        alpha = self._alpha(w)  # 1: the values stay as they are (0 for a weight of 0)
        largest = 0.0 if max_abs is None else float(max_abs)
        try:
            for name, acc in self._acc.items():
                flat = acc.view(-1)
                for start in range(0, flat.numel(), piece):
                    values = flat[start : start + piece]
                    if check is not None:
                        check(name, values)
                    if max_abs is None:
                        largest = max(largest, _largest(values))
                    if alpha != 1.0:
                        values.mul_(alpha)
            if not math.isfinite(largest):
                raise MergeError("the written values have NaN or infinite values; they cannot be counted")
        except BaseException:
            self.reset()
            raise
        self._fresh.clear()
        self._bound = alpha * largest
        self._total_weight += w
        self._count += 1

    def finish_contribution(self, weight: float) -> None:
        """Record one contributor whose tensors have all been folded with `weight`."""
        self._check_open()
        w = _check_weight(weight, "contribution")
        missing = [k for k in self._acc if k not in self._pending]
        if missing:
            raise MergeError(f"contribution is incomplete: missing keys: {_listed(missing)}")
        self._pending.clear()
        self._bound += w / (self._scale or 1.0) * self._open_max
        self._open_max = 0.0
        self._total_weight += w
        self._count += 1

    def add(self, delta: Mapping[str, torch.Tensor], weight: float, max_abs: float | None = None) -> None:
        """Fold a whole update: check it against the model, then fold every tensor."""
        self._check_open()
        check_compatible(self._specs, delta)
        _check_weight(weight, "update")
        for name in self._acc:
            self.fold(name, delta[name], weight, max_abs)
        self.finish_contribution(weight)

    def mean(self) -> TensorDict:
        """Σ wᵢΔᵢ / Σ wᵢ, computed in place: the returned tensors are the accumulators."""
        if self._divided:
            return dict(self._acc)
        tensors, divisor = self.scaled()
        if divisor != 1.0:
            for acc in tensors.values():
                acc.div_(divisor)
        self._divided = True
        return tensors

    def scaled(self) -> tuple[TensorDict, float]:
        """The accumulators and a divisor d with Σ wᵢΔᵢ / Σ wᵢ = acc / d, without the pass over
        the memory that dividing costs (d is 1 for a single contribution, and ≥ 1 unless a
        contribution was folded with more than its weight, or the sum was scaled down to stay
        finite). They are handed over as they are: call `reset()` before folding again."""
        if self._averaged:
            raise MergeError("the mean was already taken from this sum; call reset() before using it again")
        if self._pending:
            raise MergeError(
                f"a contribution is half folded ({_listed(sorted(self._pending))}); "
                "call finish_contribution() or reset()"
            )
        if self._count == 0:
            raise MergeError("no contribution was added, so there is no mean to take")
        if self._total_weight <= 0:
            raise MergeError("contributions have a total weight of 0, so their mean is undefined")
        self._averaged = True
        return dict(self._acc), self._total_weight / (self._scale or 1.0)

    def reset(self) -> None:
        """Back to no contribution, so the same memory serves the next round (nothing is
        written: the next first contribution writes over the old values)."""
        self._fresh = set(self._acc)
        self._scale = None
        self._bound = 0.0
        self._open_max = 0.0
        self._pending.clear()
        self._partial.clear()
        self._total_weight = 0.0
        self._count = 0
        self._averaged = False
        self._divided = False


def _owned(storage: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `storage` that accumulator `name` lives in, checked against the model."""
    t = storage.get(name)
    if t is None:
        raise MergeError(f"the sum's storage has no tensor {name!r}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
        raise MergeError(f"the sum's storage for {name} is {t.dtype} {_shape_str(tuple(t.shape))}, expected a "
                         f"contiguous {dtype} {_shape_str(tuple(shape))}")
    return t


def _accumulate(acc: torch.Tensor, values: torch.Tensor, w: float, fresh: bool) -> None:
    """acc += w·values; over a `fresh` accumulator (no value yet) acc = w·values, bit for bit
    what adding into zeros gives (but for the sign of a zero)."""
    if not fresh:
        acc.add_(values, alpha=w)  # promotes in the kernel: a bf16 upload needs no float32 copy
    elif w == 1.0:
        acc.copy_(values)
    elif values.dtype == acc.dtype:
        torch.mul(values, w, out=acc)
    else:  # multiply in the accumulator's precision, as add_ does, not in a narrower input dtype
        acc.copy_(values)
        acc.mul_(w)
