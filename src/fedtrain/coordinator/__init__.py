"""The coordinator: HTTP routes (app), side effects (service), pure decisions (policy), state (store)."""

from fedtrain.coordinator.auth import Tokens
from fedtrain.coordinator.server import BackgroundCoordinator
from fedtrain.coordinator.service import Coordinator

__all__ = ["BackgroundCoordinator", "Coordinator", "Tokens"]
