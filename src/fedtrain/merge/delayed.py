"""The delayed Nesterov outer step of asynchronous mode, as a `torch.optim.Optimizer`.

Liu et al., "Asynchronous Local-SGD Training for Language Modeling" (2024), found that
Nesterov momentum applied on every asynchronous update (each one a single, possibly stale,
pseudo-gradient) trains worse than synchronous DiLoCo, and proposed the Delayed Nesterov
(DN) update: the momentum moves only once every N applied updates, fed their mean, while
each update in between is applied with plain, momentum-free SGD. With outer lr η, momentum
β, the update gₜ and a buffer Δ (the sum of gᵢ/N since the last momentum step):

    Δ ← Δ + gₜ/N
    every N-th update:  m ← β·m + Δ;   θ ← θ − η·(gₜ/N + β·m);   Δ ← 0
    the others:                         θ ← θ − η·gₜ/N

(their momentum activation c = 0: no momentum at all between the momentum steps). Over one
cycle of N updates θ moves by η·(Σ gᵢ/N + β·m): one synchronous Nesterov step on the mean
of the N updates, whose parts are applied as they arrive, so no update waits for the
others. With N = 1 it is torch's Nesterov SGD, the outer step of DiLoCo.

The arithmetic is torch's own (`torch.optim.sgd.sgd`, fused where DiLoCo's SGD is, else
foreach, so that N = 1 is DiLoCo's step bit for bit): the momentum step is one
Nesterov SGD step with gradient Δ (which gives θ − η·(Δ + β·m), m ← β·m + Δ) after one plain
SGD step with gradient gₜ/N − Δ (so that θ moves by η·(gₜ/N + β·m) in all); a plain step
is one SGD step with gradient gₜ/N. N is the param group's `every`, which the caller may
change before each step (it is the number of active participants by default); a momentum
step comes once `every` updates are buffered, so a smaller N takes effect at once.

State per parameter, tensors all (so `state_dict()` round-trips it and the coordinator's
checkpoint of the outer state holds it exactly): `momentum_buffer` (m, as in torch's SGD),
`delay_buffer` (Δ) and `delay_count` (updates in Δ, a float32 scalar like Adam's `step`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.sgd import sgd

STATE_KEYS = ("delay_buffer", "delay_count", "momentum_buffer")


class DelayedNesterov(torch.optim.Optimizer):
    """Delayed Nesterov SGD (see the module): lr η, momentum β, a momentum step every `every` steps."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float, momentum: float,
                 every: int = 1, fused: bool = False) -> None:
        if not lr >= 0.0:
            raise ValueError(f"DelayedNesterov: invalid learning rate {lr}; it must be >= 0")
        if not 0.0 < momentum < 1.0:
            raise ValueError(f"DelayedNesterov: invalid momentum {momentum}; it must be in (0, 1)")
        _check_every(every)
        super().__init__(params, {"lr": lr, "momentum": momentum, "every": int(every)})
        self._fused = fused  # torch's fused kernels, where the weights' device has them (as DiLoCo's SGD)

    def set_every(self, every: int) -> None:
        """N for the next steps (updates per momentum step)."""
        _check_every(every)
        for group in self.param_groups:
            group["every"] = int(every)

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["delay_count"] = torch.tensor(0.0, dtype=torch.float32)
            state["delay_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update for every parameter with a gradient. The gradients are consumed (written into)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("DelayedNesterov does not support sparse gradients")
            states = [self._init_state(p) for p in params]
            lr, beta, every = group["lr"], group["momentum"], int(group["every"])
            grads = [p.grad for p in params]
            buffers = [s["delay_buffer"] for s in states]
            count = int(states[0]["delay_count"].item()) + 1
            torch._foreach_div_(grads, float(every))  # gₜ/N
            torch._foreach_add_(buffers, grads)  # Δ ← Δ + gₜ/N
            if count >= every:
                torch._foreach_sub_(grads, buffers)  # gₜ/N − Δ
                _sgd(params, grads, [None] * len(params), lr, 0.0, nesterov=False, fused=self._fused)
                _sgd(params, buffers, [s["momentum_buffer"] for s in states], lr, beta, nesterov=True,
                     fused=self._fused)
                for b in buffers:
                    b.zero_()
                count = 0
            else:
                _sgd(params, grads, [None] * len(params), lr, 0.0, nesterov=False, fused=self._fused)
            for s in states:
                s["delay_count"].fill_(float(count))
        return loss


def _sgd(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor | None],
         lr: float, momentum: float, *, nesterov: bool, fused: bool) -> None:
    """torch's SGD step (fused or foreach), undamped, no weight decay; momentum buffers updated in place."""
    sgd(params, grads, momentum_buffers, foreach=not fused, fused=fused, weight_decay=0.0, momentum=momentum, lr=lr,
        dampening=0.0, nesterov=nesterov, maximize=False)


def _check_every(every: int) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"DelayedNesterov: every must be an int >= 1, got {every!r}")
