"""The coordinator: HTTP routes (app), side effects (service), pure decisions (policy), state (store).

The names below load on first use (see `fedtrain/__init__.py`), so importing a light part
such as `fedtrain.coordinator.policy` does not start the server stack (uvicorn, FastAPI).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedtrain._lazy import lazy_exports

_SOURCES = {
    "fedtrain.coordinator.members.auth": ("Tokens",),
    "fedtrain.coordinator.http.server": ("BackgroundCoordinator",),
    "fedtrain.coordinator.service": ("Coordinator",),
}

if TYPE_CHECKING:
    from fedtrain.coordinator.http.server import BackgroundCoordinator
    from fedtrain.coordinator.members.auth import Tokens
    from fedtrain.coordinator.service import Coordinator
else:
    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES)

__all__ = ["BackgroundCoordinator", "Coordinator", "Tokens"]
