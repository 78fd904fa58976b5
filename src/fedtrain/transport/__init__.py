"""The transport seam: every fast IO path of fedtrain, behind small Protocols, each with a
plain path beside it that the tests also run end to end.
See docs/architecture.md (the transport seam, and its module notes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedtrain._lazy import lazy_exports as _lazy_exports

_SOURCES = {
    "fedtrain.transport.setting": ("FAST_IO_ENV", "fast_io_enabled"),
    "fedtrain.transport.protocols": (
        "READINTO",
        "SEND",
        "Abandoned",
        "BodySource",
        "CheckpointWriter",
        "Hold",
        "ModelSender",
        "Pump",
        "ResponseSink",
        "Steps",
    ),
    "fedtrain.transport.body": ("Body",),
    "fedtrain.transport.server_limits": ("ServerLimits",),
    "fedtrain.transport.http_server": ("fast_protocol",),
    "fedtrain.transport.allocator": ("tune_process",),
    "fedtrain.transport.writers": ("BufferedWriter", "checkpoint_writer"),
    "fedtrain.transport.direct": ("DirectWriter",),
    "fedtrain.transport.send": ("SocketOut", "close_send_pool"),
}

if TYPE_CHECKING:
    from fedtrain.transport.allocator import tune_process
    from fedtrain.transport.body import Body
    from fedtrain.transport.direct import DirectWriter
    from fedtrain.transport.http_server import fast_protocol
    from fedtrain.transport.protocols import (
        READINTO,
        SEND,
        Abandoned,
        BodySource,
        CheckpointWriter,
        Hold,
        ModelSender,
        Pump,
        ResponseSink,
        Steps,
    )
    from fedtrain.transport.send import SocketOut, close_send_pool
    from fedtrain.transport.server_limits import ServerLimits
    from fedtrain.transport.setting import FAST_IO_ENV, fast_io_enabled
    from fedtrain.transport.writers import BufferedWriter, checkpoint_writer
else:
    __getattr__, __dir__ = _lazy_exports(__name__, _SOURCES)

__all__ = [
    "FAST_IO_ENV",
    "READINTO",
    "SEND",
    "Abandoned",
    "Body",
    "BodySource",
    "BufferedWriter",
    "CheckpointWriter",
    "DirectWriter",
    "Hold",
    "ModelSender",
    "Pump",
    "ResponseSink",
    "ServerLimits",
    "SocketOut",
    "Steps",
    "checkpoint_writer",
    "close_send_pool",
    "fast_io_enabled",
    "fast_protocol",
    "tune_process",
]
