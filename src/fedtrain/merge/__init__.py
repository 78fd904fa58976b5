"""Pure tensor math of a merge: weighting, running weighted sums and the outer optimizers."""

from fedtrain.merge.aggregate import (
    RunningSum,
    TensorDict,
    TensorSpec,
    all_finite,
    check_compatible,
    contribution_weights,
    pseudo_gradient,
    weighted_mean,
)
from fedtrain.merge.outer import ALGORITHMS, OuterOptimizer, build_torch_optimizer
from fedtrain.merge.yogi import Yogi

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
