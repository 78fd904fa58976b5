"""The participant side: HTTP client (timeouts, retries) and the `Participant` runner."""

from fedtrain.participant.client import CoordinatorClient, RetryPolicy, Timeouts
from fedtrain.participant.runner import Participant, sync_set

__all__ = ["CoordinatorClient", "Participant", "RetryPolicy", "Timeouts", "sync_set"]
