"""The delayed Nesterov outer step of asynchronous mode (Liu et al. 2024), as a `torch.optim.Optimizer`:
the momentum moves once every N applied updates, fed their mean; the updates in between are plain
SGD steps. N = 1 is DiLoCo's Nesterov step bit for bit. The math and its state: docs/architecture.md.
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
