"""Pure tensor math of a merge: weighting, running weighted sums and the outer optimizers.

The names below load on first use (see `fedtrain/__init__.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedtrain._lazy import lazy_exports as _lazy_exports

_SOURCES = {
    "fedtrain.merge.aggregate": (
        "TensorDict",
        "TensorSpec",
        "all_finite",
        "check_compatible",
        "contribution_weights",
        "pseudo_gradient",
        "weighted_mean",
    ),
    "fedtrain.merge.running_sum": ("RunningSum",),
    "fedtrain.merge.outer": ("ALGORITHMS", "OuterOptimizer", "build_torch_optimizer"),
    "fedtrain.merge.yogi": ("Yogi",),
}

if TYPE_CHECKING:
    from fedtrain.merge.aggregate import (
        TensorDict,
        TensorSpec,
        all_finite,
        check_compatible,
        contribution_weights,
        pseudo_gradient,
        weighted_mean,
    )
    from fedtrain.merge.outer import ALGORITHMS, OuterOptimizer, build_torch_optimizer
    from fedtrain.merge.running_sum import RunningSum
    from fedtrain.merge.yogi import Yogi
else:
    __getattr__, __dir__ = _lazy_exports(__name__, _SOURCES)

__all__ = [
    "ALGORITHMS",
    "OuterOptimizer",
    "RunningSum",
    "TensorDict",
    "TensorSpec",
    "Yogi",
    "all_finite",
    "build_torch_optimizer",
    "check_compatible",
    "contribution_weights",
    "pseudo_gradient",
    "weighted_mean",
]
