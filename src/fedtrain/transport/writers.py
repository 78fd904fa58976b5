"""Checkpoint writers (`CheckpointWriter`): which one writes a checkpoint's files, and moving
the tensors a write could not take from memory to where the next write can.

`checkpoint_writer()` picks the fast one (`direct.DirectWriter`, O_DIRECT) when fast IO is
on, else the plain one (`BufferedWriter`: through the page cache; `wire.files.write_temp`
fsyncs either). `realign` is what the coordinator calls after a commit whose write named
misfits; the outer optimizer only lends its tensors (`OuterOptimizer.move_storage`) and
never learns why they move.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from fedtrain.transport.protocols import CheckpointWriter
from fedtrain.transport.setting import fast_io_enabled
from fedtrain.wire.files import write_buffered

if TYPE_CHECKING:
    import torch

    from fedtrain.merge.outer import OuterOptimizer
    from fedtrain.wire.encode import EncodedBody

__all__ = ["BufferedWriter", "checkpoint_writer", "realign"]


class BufferedWriter:
    """The plain `CheckpointWriter`: through the page cache, no misfits, nothing to place."""

    def write(self, fd: int, body: EncodedBody, digest: str | None) -> tuple[str, dict[str, int]]:
        return write_buffered(fd, body, digest), {}

    def place(self, t: torch.Tensor, offset: int, consume: bool = False) -> torch.Tensor | None:
        return None


def checkpoint_writer(fast_io: bool | None = None) -> CheckpointWriter:
    """The writer for checkpoint files: O_DIRECT when fast IO is on (`fast_io`, else
    `FEDTRAIN_FAST_IO`), through the page cache when off."""
    if not fast_io_enabled(fast_io):
        return BufferedWriter()
    from fedtrain.transport.direct import DirectWriter

    return DirectWriter()


def realign(outer: OuterOptimizer, writer: CheckpointWriter, params: Mapping[str, int],
            state: Mapping[str, int]) -> None:
    """Move `outer`'s master weights (`params`) and optimizer state tensors (`state`, by their
    `state_tensors` names), the misfits of `writer`'s last write of them, to where `writer`
    takes them from memory next time (`CheckpointWriter.place`); values unchanged, and what
    cannot be moved stays. The state tensors are moved piece by piece, their old memory given
    back as they go: the caller makes sure no other optimizer shares them. The weights are
    copied whole: a download may still read the old ones."""
    outer.move_storage(
        {name: functools.partial(writer.place, offset=offset) for name, offset in params.items()},
        {flat: functools.partial(writer.place, offset=offset, consume=True) for flat, offset in state.items()},
    )
