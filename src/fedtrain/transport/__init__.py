"""The transport seam: every fast IO path of fedtrain, behind small Protocols, each with a
plain path beside it that the tests also run end to end.

Each seam, its fast path, and the plain path:

- `BodySource` (an upload's body, the `READINTO` extension): `readinto.SocketBodySource`
  reads the socket straight into the caller's memory. Plain: none offered; `Body` reads
  the ASGI app's `receive()` chunks and copies them out.
- `ResponseSink` running a pump over a `ModelSender` (a download, the `SEND` extension):
  `send.SocketSink` and `send.SocketOut` write from memory or by `sendfile`, on worker
  threads. Plain: a chunked StreamingResponse (`coordinator.publish.ModelStream.chunks`).
- `CheckpointWriter` (checkpoint files): `direct.DirectWriter` writes with O_DIRECT, the
  tensors taken from their memory. Plain: `writers.BufferedWriter`, through the page cache
  (`wire.files.write_temp` fsyncs either).
- process tuning: `allocator.tune_process` sets glibc's mallopt thresholds. Plain: the
  allocator as it is.

The HTTP fast paths come with `readinto.ReadIntoProtocol`, uvicorn's httptools protocol
extended and held to `ServerLimits`; `http_server.fast_protocol` picks it or uvicorn's
stock protocol. `Body` is what the coordinator reads an upload from either way.

One setting switches them all (`setting.py`): `FEDTRAIN_FAST_IO=0` (or off, false, no)
turns every fast path off, and code that starts a coordinator may pass `fast_io=True/False`
to override the environment. The coordinator's direct receive into the running sum and
the participant's patch of httpcore (`http_client.py`) ask the same `fast_io_enabled()`.
The library versions whose internals a fast path touches are pinned to their tested range
(`versions.py`); outside it that path steps aside for the plain one.

Names load on first use (PEP 562): importing this package imports neither uvicorn,
httptools, starlette nor torch.
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
    "fedtrain.transport.send": ("SocketOut",),
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
    from fedtrain.transport.send import SocketOut
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
    "fast_io_enabled",
    "fast_protocol",
    "tune_process",
]
