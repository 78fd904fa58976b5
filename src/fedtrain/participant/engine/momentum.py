"""The upload's local outer momentum (`train.upload_momentum`): each participant applies the
outer SGD momentum to its own Δ before compression, and the coordinator's outer step is plain
SGD. Owns the momentum buffer of one engine's sync set (docs/training-jobs.md, Compressed
uploads; docs/architecture.md for where it sits).

With equal token weights in every round and every participant in every round, Nesterov here
with coordinator outer SGD at lr η is DiLoCo's outer Nesterov at lr η exactly (the momentum is
linear, and the mean of the buffers is the buffer of the mean). Built for topk, whose error
feedback a coordinator momentum amplified (Deep Gradient Compression's momentum correction:
the feedback delays the momentum's output instead); measured with topk 5% at M = 4 it trained
far worse than outer SGD alone (docs/quality.md), so dense codecs (int2) are the way to keep
DiLoCo's momentum with few bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class LocalMomentum:
    """m ← μ·m + Δ; sends Δ + μ·m (Nesterov) or m, as torch's SGD (dampening 0) steps."""

    def __init__(self) -> None:
        self.buffer: dict[str, torch.Tensor] = {}

    def step(self, delta: Mapping[str, torch.Tensor], momentum: float, nesterov: bool) -> dict[str, torch.Tensor]:
        """The update to send for `delta` (new tensors; `delta` is left as it is). Float tensors
        only; others pass through."""
        out: dict[str, torch.Tensor] = {}
        for name, d in delta.items():
            if not d.is_floating_point():
                out[name] = d
                continue
            m = self.buffer.get(name)
            if m is None or m.shape != d.shape or m.dtype != d.dtype:
                m = self.buffer[name] = d.detach().clone()  # torch's first step: the buffer is Δ
            else:
                m.mul_(momentum).add_(d)
            out[name] = torch.add(d, m, alpha=momentum) if nesterov else m.clone()
        return out

    def clear(self) -> None:
        self.buffer = {}
