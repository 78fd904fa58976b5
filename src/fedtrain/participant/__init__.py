"""The participant side: the `Participant` engine (one for a process, a DDP group or an FSDP
group), its HTTP client (timeouts, retries) and its local state (checkpoint, its sharded form
through DCP, metrics log). See docs/architecture.md.

The names below load on first use (see `fedtrain/__init__.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedtrain import _lazy_exports

_SOURCES = {
    "fedtrain.participant.checkpoint": ("LocalCheckpoint",),
    "fedtrain.participant.client": ("CoordinatorClient", "RetryPolicy", "Timeouts"),
    "fedtrain.participant.dcp_checkpoint": ("DcpCheckpoint",),
    "fedtrain.participant.group": ("DistributedSyncError",),
    "fedtrain.participant.metrics_log": ("MetricsLog",),
    "fedtrain.participant.outage": ("OutagePolicy",),
    "fedtrain.participant.roles": ("sync_set",),
    "fedtrain.participant.runner": ("Participant",),
}

if TYPE_CHECKING:
    from fedtrain.participant.checkpoint import LocalCheckpoint
    from fedtrain.participant.client import CoordinatorClient, RetryPolicy, Timeouts
    from fedtrain.participant.dcp_checkpoint import DcpCheckpoint
    from fedtrain.participant.group import DistributedSyncError
    from fedtrain.participant.metrics_log import MetricsLog
    from fedtrain.participant.outage import OutagePolicy
    from fedtrain.participant.roles import sync_set
    from fedtrain.participant.runner import Participant
else:
    __getattr__, __dir__ = _lazy_exports(__name__, _SOURCES)

__all__ = [
    "CoordinatorClient",
    "DcpCheckpoint",
    "DistributedSyncError",
    "LocalCheckpoint",
    "MetricsLog",
    "OutagePolicy",
    "Participant",
    "RetryPolicy",
    "Timeouts",
    "sync_set",
]
