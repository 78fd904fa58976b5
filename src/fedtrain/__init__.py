"""fedtrain: fault-tolerant federated and low-communication (DiLoCo) training for PyTorch."""

from fedtrain.config import RunConfig, load_config
from fedtrain.errors import (
    AuthError,
    ConfigError,
    CoordinatorError,
    CoordinatorUnavailable,
    FedtrainError,
    MergeError,
    ModelMismatchError,
    RoundClosedError,
    StateError,
    WireError,
)
from fedtrain.participant import (
    CoordinatorClient,
    DistributedParticipant,
    OutagePolicy,
    Participant,
    RetryPolicy,
    Timeouts,
)

__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "ConfigError",
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "DistributedParticipant",
    "FedtrainError",
    "MergeError",
    "ModelMismatchError",
    "OutagePolicy",
    "Participant",
    "RetryPolicy",
    "RoundClosedError",
    "RunConfig",
    "StateError",
    "Timeouts",
    "WireError",
    "__version__",
    "load_config",
]
