"""The participant side: HTTP client (timeouts, retries), the `Participant` runner, its torchrun
form (`DistributedParticipant`), its FSDP form (`FsdpParticipant`), and its local state
(checkpoint, its sharded form through DCP, metrics log).

The names below load on first use (see `fedtrain/__init__.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedtrain._lazy import lazy_exports as _lazy_exports

_SOURCES = {
    "fedtrain.participant.checkpoint": ("LocalCheckpoint",),
    "fedtrain.participant.client": ("CoordinatorClient", "RetryPolicy", "Timeouts"),
    "fedtrain.participant.dcp_checkpoint": ("DcpCheckpoint",),
    "fedtrain.participant.distributed": ("DistributedParticipant", "DistributedSyncError"),
    "fedtrain.participant.fsdp": ("FsdpParticipant",),
    "fedtrain.participant.metrics_log": ("MetricsLog",),
    "fedtrain.participant.outage": ("OutagePolicy",),
    "fedtrain.participant.runner": ("Participant", "sync_set"),
}

if TYPE_CHECKING:
    from fedtrain.participant.checkpoint import LocalCheckpoint
    from fedtrain.participant.client import CoordinatorClient, RetryPolicy, Timeouts
    from fedtrain.participant.dcp_checkpoint import DcpCheckpoint
    from fedtrain.participant.distributed import DistributedParticipant, DistributedSyncError
    from fedtrain.participant.fsdp import FsdpParticipant
    from fedtrain.participant.metrics_log import MetricsLog
    from fedtrain.participant.outage import OutagePolicy
    from fedtrain.participant.runner import Participant, sync_set
else:
    __getattr__, __dir__ = _lazy_exports(__name__, _SOURCES)

__all__ = [
    "CoordinatorClient",
    "DcpCheckpoint",
    "DistributedParticipant",
    "DistributedSyncError",
    "FsdpParticipant",
    "LocalCheckpoint",
    "MetricsLog",
    "OutagePolicy",
    "Participant",
    "RetryPolicy",
    "Timeouts",
    "sync_set",
]
