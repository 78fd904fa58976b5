"""Lazy exports (PEP 562) for the package `__init__`s: a public name is imported from its
module on first use, so `import fedtrain` and the light parts load nothing heavy. A leaf:
it imports nothing of fedtrain, so no `__init__` imports upward to get it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
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
