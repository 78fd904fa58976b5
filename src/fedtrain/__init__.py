"""fedtrain: fault-tolerant federated and low-communication (DiLoCo) training for PyTorch.

Public names are re-exported here and in each subpackage lazily (PEP 562, `_lazy.py`): `import fedtrain`
loads nothing heavy, and `fedtrain.Participant` imports torch only when first asked for, so
`fedtrain --help`, `fedtrain status` and the coordinator's pure policy code never pay for
torch or the server stack they do not use. Type checkers see the plain imports below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedtrain._lazy import lazy_exports

__version__ = "0.1.0"


_SOURCES = {
    "fedtrain.config": ("RunConfig", "load_config"),
    "fedtrain.errors": (
        "AuthError",
        "ConfigError",
        "CoordinatorError",
        "CoordinatorUnavailable",
        "FedtrainError",
        "MergeError",
        "ModelMismatchError",
        "NotACoordinatorError",
        "RoundClosedError",
        "StateError",
        "TLSError",
        "WireError",
    ),
    "fedtrain.participant": (
        "CoordinatorClient",
        "OutagePolicy",
        "Participant",
        "RetryPolicy",
        "Timeouts",
    ),
    "fedtrain.recipes.load": ("load_model",),
}

if TYPE_CHECKING:
    from fedtrain.config import RunConfig, load_config
    from fedtrain.errors import (
        AuthError,
        ConfigError,
        CoordinatorError,
        CoordinatorUnavailable,
        FedtrainError,
        MergeError,
        ModelMismatchError,
        NotACoordinatorError,
        RoundClosedError,
        StateError,
        TLSError,
        WireError,
    )
    from fedtrain.participant import (
        CoordinatorClient,
        OutagePolicy,
        Participant,
        RetryPolicy,
        Timeouts,
    )
    from fedtrain.recipes.load import load_model
else:
    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES)

__all__ = [
    "AuthError",
    "ConfigError",
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "FedtrainError",
    "MergeError",
    "ModelMismatchError",
    "NotACoordinatorError",
    "OutagePolicy",
    "Participant",
    "RetryPolicy",
    "RoundClosedError",
    "RunConfig",
    "StateError",
    "TLSError",
    "Timeouts",
    "WireError",
    "__version__",
    "load_config",
    "load_model",
]

