"""Where an upload's bytes land, verified: the two sinks of the intake's one flow.

`SpoolLanding` writes a body into a spool file; `SumLanding` reads the round's first body
straight into the empty sum's memory (kept because it shortens the round trip by 7-35%,
docs/benchmarks.md, "The receive into the sum"). The policy picks one (`policy.receive_path`);
`Intake.receive` lands the body through it and places the result the same way whichever it was.

More: docs/architecture.md, "coordinator/intake/landing.py".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from fedtrain import faults
from fedtrain.coordinator.intake.direct_sum import DirectUpload, read_into
from fedtrain.coordinator.intake.receive import receive_to_spool
from fedtrain.coordinator.intake.spool import SpoolFiles
from fedtrain.coordinator.intake.tickets import Upload
from fedtrain.coordinator.intake.values import ValueScan, non_finite
from fedtrain.errors import Refused
from fedtrain.transport import Body
from fedtrain.wire import BodyReader, TensorSpec

OnHeader = Callable[[dict[str, TensorSpec], dict[str, str]], None]


@dataclass(frozen=True)
class Landed:
    """An upload's bytes, verified, where they landed: a spool file (`path`; `new`: the file
    was made for it), or the sum's memory (`direct`, with the `scan` of its values)."""

    path: Path | None
    new: bool
    direct: DirectUpload | None
    scan: ValueScan | None


class Landing(Protocol):
    async def land(self, up: Upload, body: Body, on_header: OnHeader, closed: Callable[[], Refused]) -> Landed:
        """Land `body` verified (digest, length, header by `on_header`, a plain body's NaN and
        Inf); raises for a bad body, or `closed()` when the round closed while it streamed in.
        Nothing of a failed landing stays."""
        ...


class SpoolLanding:
    """The sink into a spool file (`SpoolFiles`): any upload, any time."""

    def __init__(self, files: SpoolFiles) -> None:
        self._files = files

    async def land(self, up: Upload, body: Body, on_header: OnHeader,
                   closed: Callable[[], Refused] | None = None) -> Landed:
        path, new = self._files.take()
        try:
            try:
                _, scan = await receive_to_spool(body, path, digest=up.digest, length=up.length, limit=up.limit,
                                                 on_header=on_header)
            except BaseException:
                await body.drain()
                raise
            faults.hit("upload.received", who=up.pid, round=up.round)
            if scan is not None and scan.bad is not None:
                raise non_finite(scan.bad)
        except BaseException:
            self._files.discard(path, new)
            raise
        return Landed(path, new, None, None)


class SumLanding:
    """The sink into the empty sum's memory (`storage()`: its tensors): one upload at a time.
    Its bytes are verified as they land (header, length, digest, NaN and Inf); anything wrong
    leaves the sum empty, exactly. A close of the round (or its sender's failure) while the
    body streams in stops the writes at once (`abort`). Used from the event loop only."""

    def __init__(self, storage: Callable[[], dict[str, torch.Tensor]]) -> None:
        self._storage = storage
        self._direct: DirectUpload | None = None

    @property
    def pid(self) -> str | None:
        """The participant whose upload is being received into the sum, if any."""
        return self._direct.pid if self._direct is not None else None

    @property
    def busy(self) -> bool:
        return self._direct is not None

    async def land(self, up: Upload, body: Body, on_header: OnHeader, closed: Callable[[], Refused]) -> Landed:
        direct = DirectUpload(up.pid, body)
        self._direct = direct
        targets = self._storage()
        try:
            reader = BodyReader(expected_digest=up.digest, max_bytes=up.limit, expected_length=up.length,
                                on_header=on_header, allocate=lambda spec: targets[spec.name])
            scan = await direct.read(lambda: read_into(reader, body, targets), closed)
            faults.hit("upload.received", who=up.pid, round=up.round)
        except BaseException:
            self.release(direct)  # what was written is no contribution: the sum stays empty
            raise
        return Landed(None, False, direct, scan)

    def release(self, direct: DirectUpload) -> None:
        """`direct` is counted in the sum, or given up: the sum's memory is free for the next."""
        if self._direct is direct:
            self._direct = None
        direct.finished.set()

    async def finished(self) -> None:
        """Wait until no upload is being written into the sum."""
        while self._direct is not None:
            await self._direct.finished.wait()

    def abort(self, pid: str | None = None) -> None:
        """The round is closing (or `pid`, the uploader, failed or left): an upload still
        streaming into the sum stops writing into it now (it checks before each chunk, on this
        same event loop) and gives the sum up, so neither the merge nor an upload that waits to
        fold waits for the rest of its body."""
        direct = self._direct
        if direct is not None and direct.stop(pid):
            self.release(direct)
