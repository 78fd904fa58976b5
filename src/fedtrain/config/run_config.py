"""The typed run configuration shared by the coordinator with every participant.

A run config is small, typed and validated where it is defined: unknown fields are
refused (a typo is an error, never silently ignored), every field has a default and a
description. `load_config(path)` reads YAML or JSON and turns every problem into a
`ConfigError` that names the file, the field and what is wrong. This module owns the
top-level `RunConfig`, the train, outer and eval sections, the checks across sections and
loading; the model section is `model_config`, the other sections `sections` and `privacy`, the
bounds of the fields `bounds`.

More: docs/architecture.md, "config/run_config.py".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from fedtrain.config.bounds import (
    MAX_COUNT,
    MAX_LR,
    MAX_SECONDS,
    MAX_STEPS,
    MAX_TOKENS,
    MAX_UPDATE_TOKENS,
    MAX_UPLOAD_MB,
    MB,
    MIN_HEARTBEAT_S,
    MIN_UPLOAD_MB,
    SEED_RANGE,
)
from fedtrain.config.compression import check_compression
from fedtrain.config.model_config import HFModelConfig, LoraConfig, ModelConfig
from fedtrain.config.privacy import PrivacyConfig, check_privacy
from fedtrain.config.sections import AsyncConfig, ScheduleConfig, StreamingConfig, TransferConfig
from fedtrain.config.sections import Strict as _Strict
from fedtrain.errors import ConfigError
from fedtrain.merge.outer_lr import describe as describe_outer_lr
from fedtrain.merge.outer_lr import recommended_outer_lr

__all__ = [  # with the model section and the bounds, re-exported from where they moved
    "MAX_COUNT", "MAX_LR", "MAX_SECONDS", "MAX_STEPS", "MAX_TOKENS", "MAX_UPDATE_TOKENS", "MAX_UPLOAD_MB", "MB",
    "MIN_HEARTBEAT_S", "MIN_UPLOAD_MB", "RECIPES_DIR", "SEED_RANGE", "Algorithm", "EvalConfig", "HFModelConfig",
    "LoraConfig", "ModelConfig", "OuterConfig", "RunConfig", "TrainConfig", "check_upload_limit", "load_config",
    "outer_choice", "outer_defaults", "parse_config", "recipe_path",
]

Algorithm = Literal["fedavg", "diloco", "fedavgm", "fedadam", "fedyogi"]


class EvalConfig(_Strict):
    """Evaluations around the syncs (participants) and of the global model (coordinator)."""

    every: int = Field(1, ge=1, le=MAX_COUNT,
                       description="Evaluate before and after the sync of every k-th round (and the last).")
    global_data: str | None = Field(
        None,
        description="Eval set of the coordinator's own evaluation of each new global model (a data spec: a path, "
        "stdlib:heldout, ...); off when unset.",
    )
    global_batches: int = Field(8, ge=1, le=100_000, description="Batches of the coordinator's global evaluation.")


class TrainConfig(_Strict):
    """What each participant does between two syncs (the inner loop)."""

    sync_every: int = Field(20, ge=1, le=MAX_STEPS, description="H: inner steps between two syncs.")
    lr: float = Field(3e-3, gt=0, le=MAX_LR, description="Inner optimizer (AdamW) learning rate.")
    warmup_steps: int = Field(
        0, ge=0, le=MAX_STEPS,
        description="The built-in recipes' loop: over a participant's first k inner steps its lr rises linearly "
        "to `lr` (a fresh AdamW takes large early steps; a loss spike then lands in the evals around a sync). "
        "Counted from the participant's first step; one that resumes from its run dir goes on from its count.",
    )
    weight_decay: float = Field(0.0, ge=0, le=10, description="Inner AdamW weight decay.")
    batch_size: int = Field(16, ge=1, le=MAX_STEPS, description="Sequences per inner step.")
    seq_len: int = Field(128, ge=2, le=MAX_TOKENS, description="Tokens per sequence (at most model.block_size).")
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="Gradient norm clip (0 turns it off).")
    eval_batches: int = Field(8, ge=1, le=100_000, description="Batches in one held-out evaluation.")
    compression: Literal["none", "bf16", "int8", "e3m0", "int2", "ternary", "int1", "topk"] = Field(
        "none", description="How participants send pseudo-gradients: fp32 as is, bf16, int8, e3m0 (4-bit float, "
        "Streaming DiLoCo's), int2 (2-bit), ternary (-1, 0 or 1, 1.6 bits) or int1 (the sign) with per-block "
        "scales, or topk (the largest "
        "entries of each chunk, values in topk_bits bits; needs an outer step without momentum, e.g. "
        "outer.algorithm fedavg; docs/training-jobs.md, Compression).",
    )
    compression_block: int = Field(256, ge=8, le=MAX_TOKENS,
                                   description="Values per int8, e3m0, int2, ternary or int1 scale.")
    entropy_coding: Literal["none", "deflate"] = Field(
        "none", description="Lossless coding of the block codecs' codes and scales (e3m0, int2, ternary, "
        "int1) both ways: deflate (zlib) sends each as a zlib stream, whose length the receiver bounds and "
        "checks (int2's codes measured 1.3-1.5 bits a value instead of 2; docs/training-jobs.md, Compression).",
    )
    compression_scale: Literal["fp32", "bf16"] = Field(
        "fp32", description="The block codecs' scales (e3m0, int2, ternary, int1) both ways: fp32, or bf16 for "
        "half their bytes (the codes are made against the rounded scale), which pays for a smaller "
        "compression_block.",
    )
    topk_density: float = Field(0.01, ge=1e-4, le=0.25, description="topk: share of each chunk's values sent.")
    topk_bits: Literal[2, 4] = Field(2, description="topk: bits per value sent (sign and magnitude).")
    topk_chunk: int = Field(4096, ge=64, le=65536, description="topk: values per chunk (offsets are uint16).")
    overlap: bool = Field(
        False,
        description="Keep training while the upload, merge and download run in the background, then apply "
        "the new global weights plus the local progress made meanwhile (a one-round-delayed outer update).",
    )
    error_feedback: bool = Field(
        True, description="With compression: carry what compression dropped into the next round's update."
    )
    error_feedback_decay: float = Field(
        1.0, gt=0, le=1, description="With error feedback: the share β of what waits unsent that is kept each "
        "round (Δ + β·residual is compressed). 1 keeps all of it, so every Δ is sent in the end; below 1 "
        "what waits long fades, as in SparseLoCo, where the decayed residual stands in for the "
        "outer momentum.",
    )
    upload_momentum: float = Field(
        0.0, ge=0, lt=1, description="Each participant's own outer momentum μ, applied to its Δ before "
        "compression (0: none): it sends Δ + μ·m (upload_nesterov) or m, with m ← μ·m + Δ, and the coordinator's "
        "outer step is plain SGD (outer.algorithm fedavg, its lr the outer lr). With equal token weights this is "
        "DiLoCo's outer Nesterov. With topk at M = 4 it trained far worse than outer SGD alone (docs/quality.md); "
        "docs/training-jobs.md, Compression. Not with an outer momentum, DP or secure aggregation.",
    )
    upload_nesterov: bool = Field(True, description="upload_momentum: Nesterov's form (Δ + μ·m) or plain (m).")
    download_compression: Literal["none", "int8", "e3m0", "int2", "ternary", "int1", "topk"] = Field(
        "none", description="How participants that hold the previous version receive the next: the whole fp32 "
        "model (none), or the outer step as a compressed delta (int8, e3m0, int2, ternary, int1, or topk with "
        "topk_bits bits and download_topk_density; topk needs an outer step without momentum), with the "
        "coordinator's error feedback; the published model is what was sent, bit-identical everywhere and "
        "checked by its digest (docs/training-jobs.md, Compressed downloads).",
    )
    download_topk_density: float | None = Field(
        None, ge=1e-4, le=0.25, description="topk downloads: share of each chunk's values sent (unset: topk_density)."
    )


class OuterConfig(_Strict):
    """The coordinator's outer optimizer, applied to the weighted mean pseudo-gradient."""

    algorithm: Algorithm = Field("diloco", description="fedavg | diloco | fedavgm | fedadam | fedyogi.")
    lr: float | None = Field(
        None, gt=0, le=MAX_LR, description="Outer learning rate (default per algorithm: fedavg and fedavgm 1, "
        "fedadam and fedyogi 0.01, diloco the recommended table by min_participants and train.sync_every, "
        f"docs/quality.md: {describe_outer_lr()}).",
    )
    momentum: float | None = Field(None, ge=0, lt=1, description="SGD momentum (diloco 0.9, fedavgm 0.9).")
    nesterov: bool | None = Field(None, description="Nesterov momentum (default: on for diloco).")
    beta1: float = Field(0.9, ge=0, lt=1, description="FedAdam/FedYogi first-moment decay.")
    beta2: float = Field(0.99, ge=0, lt=1, description="FedAdam/FedYogi second-moment decay.")
    eps: float = Field(1e-3, gt=0, le=10, description="FedAdam/FedYogi adaptivity tau (Reddi et al.).")
    weighting: Literal["tokens", "uniform"] = Field(
        "tokens", description="Weigh each participant by tokens processed, or equally."
    )
    aggregator: Literal["mean", "median", "trimmed_mean"] = Field(
        "mean",
        description="How the round's pseudo-gradients are combined: the weighted mean (streamed, constant memory), "
        "or the coordinate-wise median or trimmed mean (robust to a few bad updates; unweighted; updates are "
        "spooled to disk until the round closes and aggregated tensor by tensor).",
    )
    trim_fraction: float = Field(
        0.1, ge=0, lt=0.5, description="trimmed_mean: fraction of the updates cut from each end, per coordinate."
    )
    clip_norm: float | None = Field(
        None, gt=0, le=1e12,
        description="Scale each update down to this L2 norm (over all its tensors) if it is larger."
    )
    outlier_factor: float | None = Field(
        None,
        gt=1,
        le=1e6,
        description="Reject an update whose L2 norm exceeds this many times the median norm of the round's "
        "updates (needs 3 or more updates); each rejection is reported as an event. Off when unset.",
    )
    max_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Largest share of a round's weighted mean any one update may have, when the round has 3 or "
        "more updates; in a round of two (where a cap of one half would be uniform weighting) the cap is "
        "(1 + max_share) / 2, 0.75 by default, so that neither of two participants takes the merge by claiming "
        "tokens. The rest of a larger share goes to the others in proportion to their weights, and the round's "
        "record shows the capped weights. 1 turns it off.",
    )
    token_slack: float = Field(
        16.0,
        ge=1,
        le=1024,
        description="An update's token claim counts up to the inner steps its participant was told (balanced "
        "rounds: its own H; else train.sync_every) x batch_size x seq_len x this; a larger claim counts as that "
        "bound (an event says so). The slack covers torchrun groups (their ranks' tokens summed), gradient "
        "accumulation and steps trained on through an outage. The bound of the largest schedule "
        f"(x schedule.max_steps_factor in balanced rounds) must stay within {MAX_UPDATE_TOKENS:,} (2^40) tokens.",
    )


class RunConfig(_Strict):
    """Everything that defines a run; shared with every participant at join."""

    name: str = Field("fedtrain-run", min_length=1, description="Human name of the run.")
    seed: int = Field(0, ge=SEED_RANGE[0], le=SEED_RANGE[1], description="Seed of the initial global weights.")
    rounds: int = Field(10, ge=0, le=1_000_000_000, description="Rounds until the run is finished (0: no end).")
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    asynchronous: AsyncConfig = Field(default_factory=AsyncConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    privacy: PrivacyConfig | None = Field(None, description="Central differential privacy (null: off).")
    streaming: StreamingConfig | None = Field(
        None, description="Streaming DiLoCo: sync the model in K fragments, one per round (null: off)."
    )
    min_participants: int = Field(1, ge=1, le=MAX_COUNT, description="Submissions needed to close at the deadline.")
    round_timeout_s: float = Field(600.0, gt=0, le=MAX_SECONDS, description="Deadline of a round after it opens.")
    deadline: Literal["fixed", "adaptive"] = Field(
        "fixed",
        description="fixed: every round's deadline is round_timeout_s. adaptive: deadline_factor times the median "
        "time participants took to submit in the last deadline_window rounds, within "
        "[deadline_min_s, round_timeout_s].",
    )
    deadline_factor: float = Field(3.0, ge=1, le=1000,
                                   description="adaptive deadline: multiple of the median submit time.")
    deadline_min_s: float = Field(
        10.0, gt=0, le=MAX_SECONDS, description="adaptive deadline: never shorter than this."
    )
    deadline_window: int = Field(5, ge=1, le=10_000,
                                 description="adaptive deadline: closed rounds whose submit times count.")
    late_uploads: Literal["refuse", "fold"] = Field(
        "refuse",
        description="An upload for a round that already closed: refuse (409, the participant moves on) or fold "
        "it into the open round with its weight multiplied by staleness_discount per round of staleness.",
    )
    staleness_discount: float = Field(
        0.5, gt=0, le=1, description="late_uploads=fold: weight factor per round an update is late."
    )
    max_staleness: int = Field(1, ge=1, le=MAX_COUNT,
                               description="late_uploads=fold: older updates are refused with 409.")
    heartbeat_interval_s: float = Field(
        5.0, ge=MIN_HEARTBEAT_S, le=MAX_SECONDS, description="How often participants heartbeat."
    )
    heartbeat_timeout_s: float = Field(
        60.0, gt=0, le=MAX_SECONDS, description="Silence after which a participant is failed."
    )
    keep_checkpoints: int = Field(
        3,
        ge=1,
        le=10_000,
        description="Committed rounds kept on disk. The files of the last version pruned stay as two hidden "
        "spares (`.spare-*.tmp`) that the next checkpoint is written over, which is faster than a fresh file.",
    )
    digest: Literal["xxh3-128", "sha256"] = Field(
        "xxh3-128",
        description="The hash of the digests written beside every tensor body and checkpoint (both are "
        "always accepted: a digest names its algorithm). It catches corrupted and truncated bodies; "
        "authenticity comes from TLS and the tokens. xxh3-128 is ~10x cheaper per byte than sha256.",
    )
    publish_first: bool = Field(
        False,
        description="Let downloads of each round's new global model complete before the round is committed "
        "(its checkpoint is written beside them; the round commits once it is on disk). Takes the checkpoint "
        "off the round trip; a coordinator crash in that window loses that one round, and participants go "
        "back to the last committed model. Off "
        "(commit first): the new model is sent while its checkpoint is written, but each download holds back "
        "its last piece until the round is committed, so no participant holds a model that is not durable.",
    )
    max_upload_mb: float = Field(
        4096.0,
        ge=MIN_UPLOAD_MB,
        le=MAX_UPLOAD_MB,
        description="Largest accepted upload body, in MB (10^6 bytes). The coordinator refuses a value "
        "smaller than one update of the run's model, which every upload would exceed.",
    )
    max_participants_per_token: int = Field(
        64,
        ge=1,
        le=1_000_000,
        description="Active participants one participant token may hold: a join, or a failed participant's "
        "return, beyond it is refused (403 too_many_participants). The admin token has no cap.",
    )
    eviction_cooldown_s: float = Field(
        600.0,
        ge=0,
        le=MAX_SECONDS,
        description="For this long after an admin evicts a participant, its token may not take a new "
        "participant key (a new name, or a name taken over without its key): 403 evicted_recently. Its "
        "participants that present their keys go on. 0: no cool-down.",
    )

    @model_validator(mode="after")
    def _seq_fits(self) -> RunConfig:
        if self.model.recipe == "gpt" and self.train.seq_len > self.model.block_size:
            raise ValueError(f"train.seq_len ({self.train.seq_len}) exceeds model.block_size ({self.model.block_size})")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must be longer than heartbeat_interval_s")
        if self.deadline == "adaptive" and self.deadline_min_s > self.round_timeout_s:
            raise ValueError(f"deadline adaptive: deadline_min_s ({self.deadline_min_s:g}) exceeds round_timeout_s "
                             f"({self.round_timeout_s:g}); the deadline is kept within [deadline_min_s, "
                             "round_timeout_s]")
        _check_token_bound(self)
        if self.schedule.mode == "async":
            _check_async(self)
        if self.streaming is not None:
            _check_streaming(self)
        check_compression(self, outer_defaults(self)["momentum"])
        check_privacy(self)
        return self


def _check_token_bound(cfg: RunConfig) -> None:
    """The token bound of the largest update the schedule allows (the most inner steps a
    participant may be told x batch_size x seq_len x outer.token_slack) must stay within
    MAX_UPDATE_TOKENS: token sums then stay exact and within SQLite's integers."""
    t, s = cfg.train, cfg.schedule
    factor = s.max_steps_factor if s.mode == "balanced" else 1.0
    steps = max(1, math.floor(t.sync_every * factor + 1e-9))
    bound = steps * t.batch_size * t.seq_len * cfg.outer.token_slack
    if bound > MAX_UPDATE_TOKENS:
        most = f" x schedule.max_steps_factor {factor:g}" if s.mode == "balanced" else ""
        raise ValueError(f"train.sync_every {t.sync_every}{most} x train.batch_size {t.batch_size} x train.seq_len "
                         f"{t.seq_len} x outer.token_slack {cfg.outer.token_slack:g} = {bound:.3g} tokens per update, "
                         f"more than {MAX_UPDATE_TOKENS:,} (2^40): token sums would overflow; lower one of them")


def _check_async(cfg: RunConfig) -> None:
    """What asynchronous mode cannot do: it applies one update at a time, so nothing that needs a
    round's updates together, and the delayed Nesterov step needs Nesterov momentum to delay."""
    outer = cfg.outer
    if outer.aggregator != "mean":
        raise ValueError(f"schedule.mode async applies one update at a time: outer.aggregator {outer.aggregator} "
                         "needs a round's updates together; use mean")
    if outer.outlier_factor is not None:
        raise ValueError("schedule.mode async applies one update at a time: outer.outlier_factor compares a "
                         "round's updates; unset it")
    if cfg.asynchronous.outer_step == "delayed_nesterov":
        d = outer_defaults(cfg)
        if outer.algorithm not in ("diloco", "fedavgm") or not d["nesterov"] or d["momentum"] == 0:
            raise ValueError(f"asynchronous.outer_step delayed_nesterov needs Nesterov momentum (outer.algorithm "
                             f"diloco, or fedavgm with nesterov: true), not {outer.algorithm}; or set "
                             "asynchronous.outer_step: per_update")


def _check_streaming(cfg: RunConfig) -> None:
    """What Streaming DiLoCo needs of the rest of the config: rounds of H/K steps that every
    participant runs (so not balanced or asynchronous mode), H a multiple of K, tau < H/K, and no
    late update folded into a later round (that round syncs another fragment)."""
    st = cfg.streaming
    assert st is not None
    if cfg.schedule.mode != "rounds":
        raise ValueError(f"streaming needs schedule.mode rounds, not {cfg.schedule.mode}: each round syncs one "
                         "fragment, and every participant must sync it after the same H/K inner steps")
    h, k = cfg.train.sync_every, st.fragments
    if h % k:
        raise ValueError(f"train.sync_every (H={h}) must be a multiple of streaming.fragments (K={k}): one "
                         "fragment syncs every H/K inner steps")
    if st.overlap >= h // k:
        raise ValueError(f"streaming.overlap (tau={st.overlap}) must be less than H/K = {h // k}: a fragment "
                         "must be applied before the next one is sent")
    if cfg.late_uploads == "fold":
        raise ValueError("streaming needs late_uploads refuse: a late update would be folded into a round "
                         "that syncs another fragment")
    if not isinstance(st.assign, str) and len(st.assign) != k:
        raise ValueError(f"streaming.assign gives {len(st.assign)} pattern lists for {k} fragments; give one "
                         "list per fragment")


def check_upload_limit(config: RunConfig, update_bytes: int, *, source: str = "config") -> None:
    """Refuse a config whose `max_upload_mb` is smaller than one update of the run's model
    (`update_bytes`: the body a participant sends under this config's `train.compression`),
    since every upload would then be refused with 413. The caller knows the model; this
    decides, with the reason, as a ConfigError naming the field."""
    limit = int(config.max_upload_mb * MB)
    if update_bytes > limit:
        need = math.ceil(update_bytes / MB * 100) / 100
        raise ConfigError(
            f"{source}: max_upload_mb: {config.max_upload_mb:g} MB ({limit:,} bytes) is smaller than one update "
            f"of this run's model ({update_bytes:,} bytes with train.compression {config.train.compression}): "
            f"every upload would be refused; set it to at least {need:g}"
        )


def _format_validation(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


def parse_config(data: Any, *, source: str = "config") -> RunConfig:
    """Validate a plain dict into a RunConfig, or raise ConfigError naming field and problem."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {_format_validation(e)}") from None


RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
"""Where the shipped recipe configs (`*.yaml`) live; `load_config("recipe:NAME")` reads one."""


def recipe_path(name: str) -> Path:
    """The shipped recipe config `NAME` (`recipe:NAME` or `NAME`, without `.yaml`)."""
    name = name.removeprefix("recipe:")
    path = RECIPES_DIR / f"{name}.yaml"
    if "/" in name or not path.is_file():
        known = ", ".join(sorted(f.stem for f in RECIPES_DIR.glob("*.yaml")))
        raise ConfigError(f"no shipped recipe config {name!r}; the recipes are: {known}")
    return path


def load_config(path: str | Path) -> RunConfig:
    """Load a YAML or JSON run config file (or `recipe:NAME`, a shipped one); any problem is a
    ConfigError naming the file."""
    p = recipe_path(str(path)) if str(path).startswith("recipe:") else Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist (or is not a file)")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} cannot be read: {e}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from None
    return parse_config(data, source=f"config file {p}")


def outer_defaults(run: RunConfig) -> dict[str, Any]:
    """The run's outer hyperparameters: `outer`'s, with the per-algorithm defaults (paper and
    torchft values) for lr, momentum and nesterov where unset. DiLoCo's unset lr follows the
    recommended table by M = `min_participants` and H = `train.sync_every`
    (`fedtrain.merge.outer_lr`, docs/quality.md)."""
    cfg = run.outer
    table: dict[str, dict[str, Any]] = {
        "fedavg": {"lr": 1.0, "momentum": 0.0, "nesterov": False},
        "diloco": {"lr": recommended_outer_lr(run.min_participants, run.train.sync_every), "momentum": 0.9,
                   "nesterov": True},
        "fedavgm": {"lr": 1.0, "momentum": 0.9, "nesterov": False},
        "fedadam": {"lr": 1e-2, "momentum": 0.0, "nesterov": False},
        "fedyogi": {"lr": 1e-2, "momentum": 0.0, "nesterov": False},
    }
    d = dict(table[cfg.algorithm])
    if cfg.lr is not None:
        d["lr"] = cfg.lr
    if cfg.momentum is not None:
        d["momentum"] = cfg.momentum
    if cfg.nesterov is not None:
        d["nesterov"] = cfg.nesterov
    d.update(beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps)
    return d


def outer_choice(cfg: RunConfig) -> tuple[str, dict[str, Any]]:
    """The coordinator's outer optimizer for `cfg`: its algorithm and hyperparameters. In
    asynchronous mode with `asynchronous.outer_step` delayed_nesterov that is the delayed
    Nesterov variant (`merge/delayed.py`) with the configured algorithm's lr and momentum;
    otherwise `outer.algorithm` with `outer_defaults`."""
    hp = outer_defaults(cfg)
    if cfg.schedule.mode == "async" and cfg.asynchronous.outer_step == "delayed_nesterov":
        return "delayed_nesterov", hp
    return cfg.outer.algorithm, hp
