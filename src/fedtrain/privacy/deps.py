"""The optional dependencies of fedtrain.privacy, imported lazily with an error naming the extra.

`import fedtrain` and `import fedtrain.privacy` must work without `cryptography` and
`dp-accounting`; the modules that need them call `crypto()` or `dp_accounting()` at first use,
and a missing package is a `ConfigError` telling the user which extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from fedtrain.errors import ConfigError

EXTRA_HINT = "install the privacy extra: pip install 'fedtrain[privacy]'"


def _load(module: str, package: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"secure aggregation and differential privacy need {package!r}; {EXTRA_HINT}") from exc


def crypto() -> ModuleType:
    """`cryptography.hazmat.primitives` (X25519, HKDF, ChaCha20, ChaCha20-Poly1305 live under it)."""
    _load("cryptography", "cryptography")
    return _load("cryptography.hazmat.primitives", "cryptography")


def dp_accounting() -> ModuleType:
    return _load("dp_accounting", "dp-accounting")
