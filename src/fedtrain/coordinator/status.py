"""The run's status (`GET /v1/status`, `fedtrain status`, the dashboard), read from the
coordinator's parts: the run and its open round, each participant (`members/views.py`), and
the recent rounds with their bytes against fp32. Reads only; it takes the parts, never the
service, so nothing here imports `service.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fedtrain.config import RunConfig
from fedtrain.coordinator.intake.flow import Intake
from fedtrain.coordinator.members.roster import Live, Roster
from fedtrain.coordinator.members.views import participant_view
from fedtrain.coordinator.model.committer import Committer
from fedtrain.coordinator.rounds.progress import Rounds
from fedtrain.coordinator.rounds.schedule import Schedule
from fedtrain.coordinator.state.config_versions import ConfigVersions
from fedtrain.coordinator.state.store import Store

__all__ = ["round_traffic", "run_status", "streaming_view"]


def run_status(*, config: RunConfig, spec: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], store: Store,
               roster: Roster, intake: Intake, schedule: Schedule, rounds: Rounds, committer: Committer,
               configs: ConfigVersions, version: int, finished: bool, deadline: tuple[float, str],
               rounds_total: int) -> dict[str, Any]:
    """The run's status from its parts (`Coordinator.status`): the run, the open round, each
    participant (`members/views.py`), and the recent rounds with their traffic against fp32."""
    params = sum(math.prod(s) for _, s in spec.values())
    recent = store.rounds(limit=20)
    last_weights = {s["participant_id"]: s["weight"] for s in recent[0]["submissions"]} if recent else {}
    rows = roster.rows
    live = roster.live
    pieces = intake.pieces_in(version)
    told = schedule.status(version, config, list(rows))
    paced = rounds.schedule_view()  # staleness, applied updates, share of the applied weight
    fragment = rounds.fragment(version)  # Streaming DiLoCo (None: off)
    deadline_s, deadline_reason = deadline
    status = {
        "run": config.name,
        "mode": config.schedule.mode,
        "current_round": version,
        "fragment": fragment.index if fragment is not None else None,  # the one the open round syncs
        "streaming": streaming_view(config, rounds),
        "privacy": rounds.privacy.view() if rounds.privacy is not None else None,  # central DP
        "secure_aggregation": rounds.secagg.view() if rounds.secagg is not None else None,
        "rounds": rounds_total,
        "rounds_configured": config.rounds,
        "finished": finished,
        "closing": rounds.open.closing,
        "reason": rounds.open.reason,
        "deadline_s": deadline_s,
        "deadline_reason": deadline_reason,
        "algorithm": committer.model.algorithm,
        # as resolved: an unset DiLoCo lr follows M and H (outer_defaults)
        "outer_lr": committer.model.hp["lr"],
        "schedule_mode": config.schedule.mode,
        "config_version": configs.version,
        "latest_config_version": configs.latest_version,
        "parameters": params,
        "model_bytes": sum(t.numel() * t.element_size() for t in committer.model.params.values()),
        # The run's traffic: the sums of the participants' counters, which persist (a
        # download without a participant_id, such as `fedtrain export`, is not counted).
        "bytes_in": sum(p.bytes_up for p in rows.values()),
        "bytes_out": sum(p.bytes_down for p in rows.values()),
        "submitted": sorted(rounds.open.submitted),
        "participants": [{**participant_view(p, live.get(p.id, Live()), last_weights.get(p.id), pieces.get(p.id),
                                             told[p.id], roster.site_of(p.token_id)),
                          **paced.get(p.id, {}),
                          "transfer": intake.transfer_view(p.id)}  # its upload in flight (Progress.view)
                         for p in sorted(rows.values(), key=lambda p: p.id)],
        "recent_rounds": [{**r, **round_traffic(r, spec, rounds, committer)} for r in recent],
    }
    committer.downloads.add_to(status["participants"])  # and their transfers in flight
    return status


def round_traffic(record: dict[str, Any], spec: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], rounds: Rounds,
                  committer: Committer) -> dict[str, Any]:
    """A committed round's bytes against fp32: `fp32_bytes_in`, what its updates would have
    been as dense fp32 (the round's fragment with Streaming DiLoCo), `bytes_out`, what the
    participants were sent of the version it made (None: not since this coordinator
    started), and `vs_fp32_in`, how many times fewer bytes its uploads took than fp32;
    `fp32_bytes_out` and `vs_fp32_out` the same of its downloads (compressed deltas against
    whole fp32 models)."""
    plan, fragment = rounds.plan, record.get("fragment")
    names = plan.names[fragment] if plan is not None and fragment is not None else tuple(spec)
    fp32 = record["n_submissions"] * sum(4 * math.prod(spec[n][1]) for n in names if n in spec)
    bytes_in = record.get("bytes_in") or 0
    downloads = committer.downloads
    bytes_out = downloads.version_bytes(record["round"] + 1)
    fp32_out = downloads.version_fp32_bytes(record["round"] + 1)
    return {"fp32_bytes_in": fp32, "vs_fp32_in": round(fp32 / bytes_in, 2) if bytes_in else None,
            "bytes_out": bytes_out, "fp32_bytes_out": fp32_out,
            "vs_fp32_out": round(fp32_out / bytes_out, 2) if bytes_out and fp32_out is not None else None}


def streaming_view(config: RunConfig, rounds: Rounds) -> dict[str, Any] | None:
    """Streaming DiLoCo's K, τ and α for the status (None: off)."""
    st, plan = config.streaming, rounds.plan
    if st is None or plan is None:
        return None
    return {"k": plan.k, "overlap": st.overlap, "alpha": st.alpha}
