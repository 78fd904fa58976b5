"""fedtrain: fault-tolerant federated and low-communication (DiLoCo) training for PyTorch.

Public names are re-exported here and in each subpackage lazily (PEP 562): `import fedtrain`
loads nothing heavy, and `fedtrain.Participant` imports torch only when first asked for, so
`fedtrain --help`, `fedtrain status` and the coordinator's pure policy code never pay for
torch or the server stack they do not use. Type checkers see the plain imports below.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"


def _lazy_exports(
    package: str, sources: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module `__getattr__` and `__dir__` for `package`: each name in `sources[module]` is
    imported from `module` on first access and kept in the package, so later lookups are
    plain attributes. Any other name is an AttributeError, which lets `from package import
    submodule` still import the submodule."""
    where = {name: module for module, names in sources.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__


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
else:
    __getattr__, __dir__ = _lazy_exports(__name__, _SOURCES)

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
]

