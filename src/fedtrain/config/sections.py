"""Sections of the run config about how participants' work is paced and synced: the
schedule (issue #22), asynchronous mode, Streaming DiLoCo (issue #21), and how large
transfers travel (issue #34). What they need
of the rest of the config is checked by `RunConfig`'s validator. `fedtrain.config`
re-exports them; import them from there.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

#: The most connections one transfer may use at once (transfer.streams).
MAX_STREAMS = 16


class Strict(BaseModel):
    # allow_inf_nan=False: every float field refuses inf and NaN (YAML .inf, JSON Infinity).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ScheduleConfig(Strict):
    """How participants' work is paced against each other (issue #22)."""

    mode: Literal["rounds", "balanced", "async"] = Field(
        "rounds",
        description="rounds: every participant runs train.sync_every inner steps and a round waits for them "
        "(today's lockstep). balanced: rounds, but each participant gets its own number of inner steps, from its "
        "measured throughput, so that all finish together (docs/schedule.md). async: no round barrier; each "
        "update is applied to the global model as it arrives, scaled by its staleness. Live: rounds <-> balanced "
        "switches safely at the next round boundary (each participant learns its inner steps for a round when it "
        "starts it, and the merge is token-weighted either way).",
    )
    min_steps_factor: float = Field(
        0.25,
        gt=0,
        le=1,
        description="balanced: the fewest inner steps a participant is told, as a multiple of train.sync_every "
        "(at least 1 step). Live.",
    )
    max_steps_factor: float = Field(
        4.0,
        ge=1,
        le=16,
        description="balanced: the most inner steps a participant is told, as a multiple of train.sync_every; "
        "a participant's token claim is bounded by the steps it was told (outer.token_slack). Live.",
    )
    smoothing: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="balanced: weight of a participant's previous smoothed throughput in the moving average "
        "its inner steps are set from, once a round (0: only the latest measurement counts), so that one slow "
        "stretch does not swing its H. Live.",
    )


class AsyncConfig(Strict):
    """schedule.mode async: how each update is applied as it arrives (docs/schedule.md)."""

    max_staleness: int = Field(
        16,
        ge=0,
        le=1_000_000,
        description="Most global versions an update may be behind when it is applied (its staleness: versions "
        "committed since the one it was trained from); an older one is refused with 409 too_stale, and its "
        "participant trains on from the current global model.",
    )
    staleness_fn: Literal["constant", "polynomial", "hinge"] = Field(
        "polynomial",
        description="How an update's weight falls with its staleness s (Xie et al., FedAsync): constant 1; "
        "polynomial (1 + s)^-staleness_exponent; hinge 1 up to staleness_hinge, then "
        "1 / (1 + staleness_exponent x (s - staleness_hinge)).",
    )
    staleness_exponent: float = Field(
        0.5, ge=0, le=100, description="polynomial: the exponent a of (1 + s)^-a; hinge: the slope after the hinge."
    )
    staleness_hinge: int = Field(
        2, ge=0, le=1_000_000, description="hinge: the staleness up to which an update keeps its full weight."
    )
    outer_step: Literal["delayed_nesterov", "per_update"] = Field(
        "delayed_nesterov",
        description="delayed_nesterov (Liu et al. 2024): each update is applied with plain SGD at the outer lr "
        "(divided by N), and the Nesterov momentum, fed the mean of the last N updates, only once every N "
        "applied updates; needs outer.algorithm diloco (or fedavgm with nesterov). per_update: the configured "
        "outer optimizer steps on every update.",
    )
    momentum_every: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="delayed_nesterov: N, the applied updates per momentum step. Default: the number of active "
        "participants when the update is applied (at least 1), as in Liu et al.",
    )


class StreamingConfig(Strict):
    """Streaming DiLoCo (docs/streaming.md): K fragments, one synced per round, every H/K steps.

    Douillard et al. 2025. A round is one fragment's sync, so `rounds` counts fragment syncs."""

    fragments: int = Field(
        2,
        ge=1,
        le=4096,
        description="K: the fragments the sync set is split into; round r syncs fragment r mod K, so each "
        "fragment syncs every train.sync_every inner steps and the rounds come H/K steps apart. "
        "train.sync_every must be a multiple of it. Fixed for the run: each fragment keeps its own outer "
        "optimizer state and reference weights, and committed rounds are mapped to fragments by it.",
    )
    assign: Literal["strided", "sequential"] | list[list[str]] = Field(
        "strided",
        description="Which parameter goes in which fragment: strided (fragment p holds blocks p, p+K, ...: the "
        "paper's choice), sequential (contiguous runs of blocks), or one list of name patterns (fnmatch, "
        "whole names) per fragment. Parameters outside every block go with the block before them (embeddings "
        "with the first). Fixed for the run, for the same reason as fragments.",
    )
    overlap: int = Field(
        1,
        ge=0,
        le=1_000_000,
        description="tau: inner steps trained while a fragment's sync is in flight; the fragment is sent tau "
        "steps before its round ends and its merged result applied at the end. 0 <= tau < H/K. Live.",
    )
    alpha: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Mixing factor when a fragment's result arrives: theta <- (1 - alpha) * theta_global + "
        "alpha * theta_local (alpha weights the local side, as in torchft; 0 takes the global fragment as it "
        "comes). Live.",
    )


class TransferConfig(Strict):
    """How large bodies travel between participants and the coordinator (docs/training-jobs.md):
    in resumable parts, over one or more connections, and when a silent connection is given up."""

    part_mb: int = Field(
        32,
        ge=1,
        le=1024,
        description="An update larger than this many MiB travels as parts of this size, each checked by its own "
        "digest as it arrives; after a broken connection only the parts the coordinator does not hold are sent "
        "again. A broken download resumes from the byte where it stopped. Live.",
    )
    streams: Annotated[int, Field(strict=True, ge=1, le=MAX_STREAMS)] | Literal["auto"] = Field(
        1,
        description="Connections one transfer may use at once (1 to 16), both directions: an upload's parts, or "
        "a download's byte ranges, go over this many connections side by side. auto: from measurement "
        "(docs/training-jobs.md). More than one pays on links with high latency; on a clean link one "
        "connection fills it. Live.",
    )
    stall_timeout_s: float = Field(
        10.0,
        ge=1,
        le=3600,
        description="A transfer whose connection moves no byte for this long is given up and tried again on a "
        "new connection, which takes over from the silent one (the coordinator closes the older). Live.",
    )

