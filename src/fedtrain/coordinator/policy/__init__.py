"""The coordinator's pure decisions, each returned with its reason in words: when a round
closes and who has gone silent (`closing`), whether and how an upload is taken (`admission`),
what an update may weigh (`shares`), asynchronous mode (`async_rules`) and balanced rounds
(`balance`). Nothing here reads a clock, a socket or a file: each rule is tested by passing
the time in. The names of `closing`, `admission` and `shares` are re-exported here, so callers
write `policy.decide_round`. See docs/architecture.md (policy)."""

from __future__ import annotations

from fedtrain.coordinator.policy.admission import (
    DIRECT_MAX_ACTIVE,
    Admission,
    Placement,
    ReceivePath,
    admit_upload,
    keeps_every_update,
    place_update,
    receive_path,
)
from fedtrain.coordinator.policy.closing import (
    ACTIVE,
    EVICTED,
    FAILED,
    LEFT,
    Decision,
    ParticipantView,
    RoundView,
    adaptive_deadline,
    change_effective,
    decide_round,
    round_state,
    run_finished,
    stale_participants,
)
from fedtrain.coordinator.policy.shares import (
    MAX_SUM,
    MIN_FOR_CAP,
    Contribution,
    bounded_sum,
    cap_for,
    cap_shares,
    closing_weights,
    count_tokens,
    largest_influence,
    over_share,
    pair_cap,
    retain_all,
    to_fold,
    token_bound,
)

__all__ = [
    "ACTIVE",
    "DIRECT_MAX_ACTIVE",
    "EVICTED",
    "FAILED",
    "LEFT",
    "MAX_SUM",
    "MIN_FOR_CAP",
    "Admission",
    "Contribution",
    "Decision",
    "ParticipantView",
    "Placement",
    "ReceivePath",
    "RoundView",
    "adaptive_deadline",
    "admit_upload",
    "bounded_sum",
    "cap_for",
    "cap_shares",
    "change_effective",
    "closing_weights",
    "count_tokens",
    "decide_round",
    "keeps_every_update",
    "largest_influence",
    "over_share",
    "pair_cap",
    "place_update",
    "receive_path",
    "retain_all",
    "round_state",
    "run_finished",
    "stale_participants",
    "to_fold",
    "token_bound",
]
