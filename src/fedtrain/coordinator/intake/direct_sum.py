"""An upload received straight into the running sum's memory (`landing.SumLanding`).

More: docs/architecture.md, "coordinator/intake/direct_sum.py".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import torch

from fedtrain.coordinator.intake.values import ValueScan
from fedtrain.errors import Refused
from fedtrain.transport import Abandoned, Body
from fedtrain.wire import BodyReader

# A direct receive reads the body into the sum this many bytes at a time, and hashes each
# piece while it is still in the CPU's cache.
PIECE = 1 << 20


class DirectUpload:
    """The one upload being written into the sum: whose, and whether it was stopped."""

    def __init__(self, pid: str, body: Body) -> None:
        self.pid = pid
        self.body = body
        self.streaming = True  # the body is still arriving: a close of the round stops it
        self.aborted = False
        self.interrupted = False  # stopped because its participant failed or left, not by a close
        self.finished = asyncio.Event()

    def stop(self, pid: str | None) -> bool:
        """Stop writing (a close when `pid` is None, else the failure of `pid`) if it is this
        upload and still streaming: no byte lands in the sum after this. Whether it stopped."""
        if not self.streaming or pid not in (None, self.pid):
            return False
        self.aborted, self.interrupted = True, pid is not None
        self.body.abandon()
        return True

    async def read(self, reading: Callable[[], Awaitable[ValueScan | None]],
                   closed: Callable[[], Refused]) -> ValueScan | None:
        """Run `reading` (the whole body into the sum); its scan. Stopped meanwhile: raises
        503 `upload_interrupted` if its participant failed or left (sending again is fine),
        else `closed()` (the round's refusal). Any failure lets the rest of the body go."""
        try:
            scan = None
            try:
                scan = await reading()
            except Abandoned:
                if not self.aborted:  # abandoned by someone else (a newer attempt took over): not a body
                    raise
            if self.aborted:
                if self.interrupted:
                    raise Refused(503, "upload_interrupted", f"the upload of {self.pid} was stopped when the "
                                  "coordinator marked it failed or gone; send it again")
                raise closed()
        except BaseException:
            await self.body.drain()
            raise
        self.streaming = False
        return scan


async def read_into(reader: BodyReader, body: Body, targets: dict[str, torch.Tensor]) -> ValueScan | None:
    """Read a whole body through `reader`: its header fed, its data read straight into
    `targets` (the tensors the reader allocates), each piece hashed and scanned for NaN, Inf
    and its largest |value| as it lands (still in the CPU's cache). Raises WireError for a
    bad body; returns the scan (None for a body without data)."""
    scan: ValueScan | None = None
    pos = 0
    while not reader.done:
        need = reader.head_needed
        if need:
            head = await body.read(need)
            reader.feed(head)
            pos += len(head)
            if len(head) < need:
                break
            continue
        if scan is None:  # the header is in: the first data byte comes next
            scan = ValueScan(reader.layout, targets)
        view = reader.writable()
        assert view is not None
        view = view[:PIECE]
        n = await body.readinto(view)
        reader.wrote(n)
        pos += n
        scan.landed(pos)
        if n < len(view):
            break
    extra = await body.read(1)
    if extra:
        reader.feed(extra)  # raises: trailing bytes
    reader.finish()
    return scan
