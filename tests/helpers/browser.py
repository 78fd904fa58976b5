"""What the browser tests share besides their fixtures (tests/browser/conftest.py): the page
and its script errors, the live run's participants, where screenshots go."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import Participant
from tests.helpers.tiny import TinyParticipant

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


SITES = ("site-a", "site-b", "site-c")


@dataclass
class Page:
    """A fresh browser context (its own localStorage) and the script errors it raised."""

    page: Any
    errors: list[str] = field(default_factory=list)


@dataclass
class LiveRun:
    """The run's coordinator and its participants (by site name), training until `stop` is set."""

    coordinator: BackgroundCoordinator
    participants: dict[str, TinyParticipant] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return self.coordinator.url

    @property
    def feds(self) -> dict[str, Participant]:
        """The participants that have joined, by site name."""
        return {name: p.fed for name, p in self.participants.items() if p.fed is not None}

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {name: p.optimizer for name, p in self.participants.items() if p.fed is not None}

    @property
    def errors(self) -> list[BaseException]:
        return [p.error for p in self.participants.values() if p.error is not None]
