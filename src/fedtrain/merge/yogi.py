"""The Yogi optimizer as a `torch.optim.Optimizer`: the outer step of FedYogi.

torch ships SGD and Adam but not Yogi, so this is the one optimizer fedtrain writes
itself. It follows Reddi et al., "Adaptive Federated Optimization" (ICLR 2021),
Algorithm 2, FedYogi branch, which applies Yogi (Zaheer et al., NeurIPS 2018) to the
averaged pseudo-gradient g:

    m ← β1·m + (1 − β1)·g
    v ← v − (1 − β2)·g²·sign(v − g²)
    θ ← θ − lr · m / (√v + eps)

Choices, both those of Reddi et al.:

- No bias correction. `eps` plays the part of their adaptivity τ, and the initial v
  bounds the first steps instead: the first update is about lr·sign(g) elementwise.
- The initial second moment is v₀ = `initial_accumulator`, by default eps² (τ², the
  smallest value their analysis allows, "v₋₁ ≥ τ²"). v stays positive: a step either
  adds (1 − β2)g² or removes at most (1 − β2)g² < v.

State per parameter (`exp_avg`, `exp_avg_sq`, `step`) is held as tensors, as in
`torch.optim.Adam`, so `state_dict()`/`load_state_dict()` round-trip it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Yogi(torch.optim.Optimizer):
    """Yogi without bias correction, v₀ = eps² unless `initial_accumulator` says otherwise."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-3,
        initial_accumulator: float | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Yogi: invalid learning rate {lr}; it must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Yogi: invalid betas {betas}; both must be in [0, 1)")
        if not eps > 0.0:
            raise ValueError(f"Yogi: invalid eps {eps}; it must be > 0")
        if initial_accumulator is not None and not initial_accumulator >= 0.0:
            raise ValueError(f"Yogi: invalid initial_accumulator {initial_accumulator}; it must be >= 0")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "initial_accumulator": initial_accumulator,
        }
        super().__init__(params, defaults)

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            v0 = group["initial_accumulator"]
            v0 = group["eps"] ** 2 if v0 is None else v0
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.full_like(p, v0, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Yogi step for every parameter that has a gradient (gradients are only read)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Yogi does not support sparse gradients")
                state = self._init_state(p, group)
                grad, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                grad_sq = grad * grad
                # v − (1 − β2)·g²·sign(v − g²), with one temporary reused for the sign term
                change = torch.sub(v, grad_sq).sign_().mul_(grad_sq)
                v.add_(change, alpha=-(1.0 - beta2))
                denom = torch.sqrt(v, out=change).add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"])
        return loss
