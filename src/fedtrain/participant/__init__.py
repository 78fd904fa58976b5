"""The participant side: HTTP client (timeouts, retries), the `Participant` runner, its torchrun
form (`DistributedParticipant`), and its local state (checkpoint, metrics log)."""

from fedtrain.participant.checkpoint import LocalCheckpoint
from fedtrain.participant.client import CoordinatorClient, RetryPolicy, Timeouts
from fedtrain.participant.distributed import DistributedParticipant, DistributedSyncError
from fedtrain.participant.metrics_log import MetricsLog
from fedtrain.participant.outage import OutagePolicy
from fedtrain.participant.runner import Participant, sync_set

__all__ = [
    "CoordinatorClient",
    "DistributedParticipant",
    "DistributedSyncError",
    "LocalCheckpoint",
    "MetricsLog",
    "OutagePolicy",
    "Participant",
    "RetryPolicy",
    "Timeouts",
    "sync_set",
]
