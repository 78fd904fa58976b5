"""How the status shows one participant: its counters, what it last reported, its weight in
the last round, its processes, its open round's update in pieces, and its H for the open round.
Pure: plain data in, a JSON-ready dict out."""

from __future__ import annotations

from typing import Any

from fedtrain.coordinator.intake.pieces import PiecesIn
from fedtrain.coordinator.members import processes
from fedtrain.coordinator.members.roster import Live
from fedtrain.coordinator.state.store import ParticipantRow


def participant_view(p: ParticipantRow, live: Live, weight: float | None, pieces: PiecesIn | None,
                      told: dict[str, Any], site: str | None = None) -> dict[str, Any]:
    """One participant in the status: its counters, what it last reported, its weight in the
    last round, its processes (`processes.describe`), its open round's update in pieces, if any,
    its H for the open round with the reason (`told`: `Schedule.status`), and the token it
    joined with: its fingerprint and the site it was minted for (`site`; None for a token given
    on the coordinator's command line)."""
    parallel, world_size = processes.describe(p.info)
    return {
        "id": p.id,
        "state": p.state,
        "token_id": p.token_id,
        "site": site,
        "round": p.round,
        "tokens": p.tokens,
        "bytes_up": p.bytes_up,
        "bytes_down": p.bytes_down,
        "last_seen": p.last_seen,
        "step": live.step,
        "loss": live.loss,
        "tokens_per_s": live.tokens_per_s,
        "config_version": p.config_version,
        "weight": weight,
        "parallel": parallel,
        "world_size": world_size,
        "pieces": pieces.view() if pieces is not None else None,
        "sync_every": told["sync_every"],
        "sync_every_reason": told["reason"],
    }
