"""The participant side: the `Participant` engine (one for a process, a DDP group or an FSDP
group), its HTTP client (timeouts, retries) and its local state (checkpoint, its sharded form
through DCP, metrics log). See docs/architecture.md.

The names below load on first use (see `fedtrain/__init__.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedtrain._lazy import lazy_exports as _lazy_exports

_SOURCES = {
    "fedtrain.participant.local.checkpoint": ("LocalCheckpoint",),
    "fedtrain.participant.client.coordinator_client": ("CoordinatorClient", "RetryPolicy", "Timeouts"),
    "fedtrain.participant.local.dcp_checkpoint": ("DcpCheckpoint",),
    "fedtrain.participant.ranks.control": ("DistributedSyncError",),
    "fedtrain.participant.local.metrics_log": ("MetricsLog",),
    "fedtrain.participant.engine.outage": ("OutagePolicy",),
    "fedtrain.participant.ranks.roles": ("sync_set",),
    "fedtrain.participant.engine.participant": ("Participant",),
}

if TYPE_CHECKING:
    from fedtrain.participant.client.coordinator_client import CoordinatorClient, RetryPolicy, Timeouts
    from fedtrain.participant.engine.outage import OutagePolicy
    from fedtrain.participant.engine.participant import Participant
    from fedtrain.participant.local.checkpoint import LocalCheckpoint
    from fedtrain.participant.local.dcp_checkpoint import DcpCheckpoint
    from fedtrain.participant.local.metrics_log import MetricsLog
    from fedtrain.participant.ranks.control import DistributedSyncError
    from fedtrain.participant.ranks.roles import sync_set
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
