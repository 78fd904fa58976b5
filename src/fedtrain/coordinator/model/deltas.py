"""Compressed downloads on the coordinator: the error feedback, the delta of the newest version,
and its download.

`DownloadDeltas` owns the codec in force (`train.download_compression`) and the residual E
(fp32, one tensor per synced tensor). Around each outer step (`Committer.step`, the merge's
worker thread, under the fold lock) it sets the published model P_{r+1} = P_r + decode(C)
into the master weights and keeps E_{r+1} (`wire/delta.py`), of the tensors the step moved
(a Streaming DiLoCo fragment's, or all); the publish then wraps C as a
`PublishedDelta` beside the version's `Published` body: both are served from memory, the
delta to participants that hold P_r (`GET /v1/model/delta?from=r`). The residual is written
with the version's checkpoint; a version served from its file (after a restart, a roll back)
has no delta: its downloads are whole.

Memory: E (one model, fp32) for the run. P_r, which the delta is computed from after the outer
step made G, is read back from version r's model file one tensor at a time
(`published_file.py`); only when that file cannot serve (missing, or it does not check out)
is it copied from memory before the step: one more model during that merge.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from fedtrain.coordinator.model.publish import SEND_PIECE, Published, PublishedDelta, pieces
from fedtrain.transport.protocols import ModelSender, Steps
from fedtrain.wire import EncodedBody
from fedtrain.wire.compress import Codec
from fedtrain.wire.delta import delta_metadata, encode_delta

__all__ = ["DeltaStream", "DownloadDeltas"]


class DownloadDeltas:
    """The codec of compressed downloads, the residual, and the delta made by the last step
    (until `publish` puts it beside its version). Threads: the merge's worker thread changes it
    (`encode` under the fold lock, then `publish`), and `configure` and `reset` run under the
    fold lock; the commit thread reads a `PublishedDelta`'s residual, whose tensors the next
    `encode` updates in place: that merge waits for the commit (`Rounds._settle_commit`)."""

    def __init__(self) -> None:
        self.codec: Codec | None = None
        self.residual: dict[str, torch.Tensor] = {}
        self._made: tuple[dict[str, torch.Tensor], dict[str, str]] | None = None

    @property
    def on(self) -> bool:
        return self.codec is not None

    def configure(self, codec: Codec | None) -> bool:
        """The codec in force from the next step; off drops the residual (nothing can send it
        any more: the whole model goes out). True when that dropped one."""
        self.codec = codec
        if codec is None and self.residual:
            self.residual = {}
            return True
        return False

    def load(self, residual: Mapping[str, torch.Tensor] | None) -> None:
        """The residual a checkpoint kept (None: none, E = 0)."""
        self.residual = dict(residual or {})
        self._made = None

    def reset(self) -> None:
        """Back to a kept version or after a refused step: no delta pending, E = 0."""
        self.residual = {}
        self._made = None

    def before_step(self, params: Mapping[str, torch.Tensor], names: Collection[str] | None,
                    kept: Mapping[str, torch.Tensor] | None = None) -> Mapping[str, torch.Tensor] | None:
        """P_r through the outer step, of the tensors `names` (a Streaming DiLoCo fragment's: the
        step moves only those) or all; None: no delta this step, downloads are off. `kept`: P_r
        read back from its file, tensor by tensor (`PublishedFile`, over the same names), taken
        as it is; without it P_r is copied now (one more model in memory for the merge)."""
        self._made = None
        if self.codec is None:
            return None
        if kept is not None:
            return kept
        return {n: t.detach().clone() for n, t in params.items() if names is None or n in names}

    def encode(self, prev: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> None:
        """After the outer step: `params` (G) become P_{r+1} = P_r + decode(C) in place, E moves on.
        The caller moved the weights' epoch on first (no download reads them meanwhile)."""
        assert self.codec is not None
        tensors, meta, left = encode_delta(prev, {n: params[n] for n in prev}, self.residual, self.codec)
        self.residual.update(left)  # (a fragment's step: the other tensors' residual stays)
        self._made = (tensors, meta)

    def publish(self, published: Published) -> PublishedDelta | None:
        """The delta of the last step as the body that leads to `published` (None: no delta)."""
        made, self._made = self._made, None
        if made is None or self.codec is None:
            return None
        tensors, _ = made
        meta = delta_metadata(self.codec, published.version - 1, published.version, published.digest,
                              published.body.metadata)
        body = EncodedBody(tensors, meta, digest_algorithm=published.body.digest_algorithm)
        body.digest()
        return PublishedDelta(published.version - 1, published, body, self.residual)


@dataclass
class DeltaStream:
    """One download of a `PublishedDelta`, from memory (it never changes); like the whole
    model's, its last piece waits for the version's commit when the version is held."""

    delta: PublishedDelta

    @property
    def version(self) -> int:
        return self.delta.target.version

    @property
    def digest(self) -> str:
        return self.delta.digest

    @property
    def size(self) -> int:
        return self.delta.body.content_length

    @property
    def fp32_scale(self) -> float:
        """The whole model's bytes per byte of this body (the status's fp32-equivalent bytes down)."""
        return self.delta.target.body.content_length / max(1, self.size)

    def steps(self, out: ModelSender) -> Steps:
        memory = self.delta.target
        for view, last in pieces(self.delta.body, SEND_PIECE):
            if last and memory.hold:
                if not memory.settled.is_set():
                    yield memory
                memory.check_durable()
            while view:
                n = out.write_some(view)
                if n:
                    view = view[n:]
                else:
                    yield None

    def close(self) -> None:
        pass
