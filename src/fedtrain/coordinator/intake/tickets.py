"""What the intake hands around: an upload on its way in (`Upload`), its place in the open
round once verified (`Ticket`), the round's places (`Seats`, which `uploads.Uploads` gives),
what became of one piece of an update (`PieceAnswer`), and the count of folds in flight
(`FoldsInFlight`, with a wait for none). Plain data; the event loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from fedtrain.coordinator import policy
from fedtrain.errors import Refused


@dataclass(frozen=True)
class Upload:
    """One participant's update on its way in: who, for which round, and what its body claims."""

    pid: str
    round: int
    tokens: int
    digest: str
    length: int
    limit: int


@dataclass
class Ticket:
    """An upload's place in the open round, reserved once its body is verified: its key (the
    participant, or `pid@lateR` for a late fold), admission and fold weight. `release` gives
    the place back when the upload fails after all."""

    key: str
    admission: policy.Admission
    weight: float
    open_round: int  # the round it goes into
    release: Callable[[], None]


class Seats(Protocol):
    """The open round's places for updates (`rounds.Rounds`)."""

    async def wait_seat(self, up: Upload) -> None:
        """Before `reserve`: wait until the open round may take `up` (asynchronous mode: it
        holds no other update and is not closing; bounded), at once otherwise."""

    def reserve(self, up: Upload) -> Ticket | None:
        """After `up`'s body is verified: its place in the open round, None for a duplicate;
        raises Refused when the round no longer takes it (closed meanwhile)."""

    def refusal(self, up: Upload) -> Refused:
        """Why the round stopped taking `up` while its body streamed in."""


@dataclass(frozen=True)
class PieceAnswer:
    """What became of one piece: the update's ticket once complete (None before, or for a
    duplicate), whether this piece completed it or came before, the pieces in, the tensors
    still missing, and the update's bytes and digest so far."""

    ticket: Ticket | None
    complete: bool
    duplicate: bool
    pieces: int
    missing: list[str]
    length: int
    digest: str

    @classmethod
    def so_far(cls, pieces: int, missing: list[str], length: int, digest: str) -> PieceAnswer:
        """A piece taken that leaves its update incomplete: the pieces in, what is still missing."""
        return cls(None, False, False, pieces, missing, length, digest)


class FoldsInFlight:
    """A count of folds in flight (event loop only), with a wait for none."""

    def __init__(self) -> None:
        self.count = 0
        self._none = asyncio.Event()
        self._none.set()

    def enter(self) -> None:
        self.count += 1
        self._none.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._none.set()

    async def wait_none(self) -> None:
        while self.count:
            await self._none.wait()
