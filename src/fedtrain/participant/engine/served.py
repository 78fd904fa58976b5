"""The model as the coordinator served it, kept bit for bit for compressed downloads.

With `train.download_compression` on, a participant's engine keeps the served global model
(fp32, on the CPU, in the body's tensor order: one more copy of the sync set) and its version.
A whole download sets it (`take_whole`); the next version then comes as the compressed delta
from it (`take_delta`, `GET /v1/model/delta?from=`), applied with the coordinator's own function
(`wire.delta.apply_delta`) and checked against the version's digest. The engines of a Streaming
DiLoCo participant's fragments share one: a round's delta holds its fragment's tensors (the
others did not move), and the digest covers the whole model. Whenever that cannot be
done (nothing held, the coordinator has no delta from our version: we were behind, it
restarted, it went back; or the result does not check) the caller downloads the model whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from fedtrain.errors import CoordinatorError, WireError
from fedtrain.participant.client.coordinator_client import CoordinatorClient
from fedtrain.participant.client.retry import RetryPolicy
from fedtrain.wire import TensorSpec
from fedtrain.wire.delta import apply_delta, info_of, target_body
from fedtrain.wire.digest import digests_equal

__all__ = ["NO_DELTA", "ServedModel"]

log = logging.getLogger("fedtrain.participant")

#: The refusals that mean "no delta from your version": download the model whole.
NO_DELTA = frozenset({"no_delta", "delta_unavailable"})

OnHeader = Callable[[dict[str, TensorSpec], dict[str, str]], None]


class ServedModel:
    """The served model and its version (nothing until a whole download). One thread uses it
    (its engine's)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.deltas_taken = 0  # versions taken as a delta (the rest came whole)

    def forget(self) -> None:
        self.tensors, self.version = {}, None

    def take_whole(self, client: CoordinatorClient, pid: str, on_header: OnHeader | None, retry: RetryPolicy | None,
                   which: dict[str, Any]) -> tuple[int, dict[str, torch.Tensor]]:
        """Download the model whole (`which`: the client's version, stall and stream fields) and
        keep it as served; returns (its version, its tensors)."""
        self.forget()
        got, tensors = client.download(pid=pid, on_header=on_header, retry=retry, **which)
        self.tensors, self.version = tensors, int(got)
        return int(got), tensors

    def take_delta(self, client: CoordinatorClient, pid: str, retry: RetryPolicy | None,
                   stall_timeout_s: float | None) -> tuple[int, int] | None:
        """The newest version as the compressed delta from the one held, applied in place and
        checked; returns (its version, the bytes of the delta's tensors), or None when the
        caller must download the model whole (then nothing is held any more)."""
        since = self.version
        if since is None:
            return None
        meta: dict[str, str] = {}
        try:
            got, tensors = client.download(pid=pid, delta_from=since, retry=retry, stall_timeout_s=stall_timeout_s,
                                           on_header=lambda _specs, m: meta.update(m))
        except CoordinatorError as e:
            if e.code not in NO_DELTA:
                raise
            log.info("no compressed download from version %d (%s): downloading the model whole", since, e.code)
            return None
        held, version = self.tensors, int(got)
        self.forget()  # changed in place below: held again only once the result checks
        try:
            info = info_of(meta)
            apply_delta(held, tensors, meta, out=held, partial=True)  # the coordinator's own computation
            same = (info.from_version, info.to_version) == (since, version) and \
                digests_equal(target_body(held, info).digest(), info.digest)  # all of it, in the body's order
        except WireError as e:
            log.warning("the compressed download from version %d is unusable (%s): downloading the model whole",
                        since, e.message)
            return None
        if not same:
            log.warning("the model made from version %d and its compressed delta does not match the digest of "
                        "version %d: downloading the model whole", since, version)
            return None
        self.tensors, self.version = held, version
        self.deltas_taken += 1
        return version, sum(t.numel() * t.element_size() for t in tensors.values())
