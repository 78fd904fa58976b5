"""How much a stale update counts: the staleness functions of asynchronous federated training.

An update trained from global version v and applied when the model is at version w has
staleness s = w − v (the versions committed meanwhile). Asynchronous mode multiplies the
update by α(s) before the outer step (θ ← OuterOpt(θ, grad = α(s)·Δ)), so that an update
computed against an old model moves the current one less. The three functions are those of
Xie et al., "Asynchronous Federated Optimization" (FedAsync, 2019), §5:

    constant     α(s) = 1
    polynomial   α(s) = (1 + s)^(−a)
    hinge        α(s) = 1                     for s ≤ b
                 α(s) = 1 / (1 + a·(s − b))   for s > b

Each is 1 for a fresh update (s = 0), never increases with s, and stays in (0, 1]. Pure
arithmetic on numbers, no tensors: the caller scales the update by the result.
"""

from __future__ import annotations

import math

STALENESS_FUNCTIONS = ("constant", "polynomial", "hinge")


def staleness_factor(staleness: int, fn: str, exponent: float = 0.5, hinge: int = 0) -> float:
    """α(s) for staleness `staleness` (an int ≥ 0) under function `fn` (see the module):
    `exponent` is a (polynomial's exponent, hinge's slope), `hinge` is b."""
    if fn not in STALENESS_FUNCTIONS:
        raise ValueError(f"unknown staleness function {fn!r}; choose one of {', '.join(STALENESS_FUNCTIONS)}")
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness must be an int >= 0, got {staleness!r}")
    if not (math.isfinite(exponent) and exponent >= 0):
        raise ValueError(f"the staleness exponent must be finite and >= 0, got {exponent!r}")
    if hinge < 0:
        raise ValueError(f"the staleness hinge must be >= 0, got {hinge!r}")
    if fn == "constant":
        return 1.0
    if fn == "polynomial":
        return float((1.0 + staleness) ** -exponent)
    if staleness <= hinge:
        return 1.0
    return 1.0 / (1.0 + exponent * (staleness - hinge))
