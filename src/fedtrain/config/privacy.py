"""The run config's `privacy` section (central or distributed differential privacy and secure
aggregation, issue #33) and what they need of the rest of the config; the compositions that cannot
work are refused here, each with its reason (secure aggregation's: `_secagg_refusal`).

Central DP: each update is clipped to L2 norm `clip_norm` C over the round's sync set (by the
participant, and again by the coordinator, which trusts no one's clipping: `outer.clip_norm` is
taken down to C), and the coordinator adds N(0, (σ·w_max·C)²) to each coordinate of the round's
weighted mean before the outer step (w_max: the round's largest capped share). The accountant
composes one Gaussian mechanism of noise multiplier σ per committed round (docs/privacy.md).

Refused with DP on, and why:
- `schedule.mode async`: every version is one participant's update alone (its share is 1), and
  a participant's updates are applied at their own pace, so the accounting would be per applied
  update and per participant, not per round: not built.
- `outer.aggregator` median / trimmed_mean: one update moves a coordinate-wise median or trimmed
  mean by an amount no norm bound on that update controls; the sensitivity w_max·C holds for the
  weighted mean only.
- `outer.outlier_factor`: whether an update is left out depends on the others' norms, so one
  participant's data decides another's inclusion: the sensitivity is no longer one update's.
- `late_uploads fold`: a participant's late update and its current one could land in one merge,
  a contribution of up to twice its share·C.
- `sampling poisson`: fedtrain does not sample cohorts; the amplification Poisson sampling gives
  would be claimed for a sampling that never happened.
- `rounds: 0` (no end) with an `epsilon_budget`: the budget rule refuses a run before it starts
  when its planned rounds would spend more than the budget, and a run without an end has no plan.
- planned rounds over the budget: refused with the ε they would reach (`refuse_over_budget`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from fedtrain.config.sections import Strict
from fedtrain.errors import ConfigError

#: The most participants one round's secure aggregation may take (a bound for every schema).
MAX_SECAGG_PARTICIPANTS = 4096
#: Reason shown for a live change of the privacy section (config/changes.py FIXED_FIELDS).
FIXED_REASON = ("the accountant composes every committed round with the σ, C and δ in force from the start: a "
                "change mid-run would make the reported ε wrong")


class PrivacyConfig(Strict):
    """Differential privacy and secure aggregation (docs/privacy.md): clipping, Gaussian noise (at the
    coordinator, or split among the participants with secure aggregation), an (ε, δ) accountant, and
    masked uploads. Fixed for the life of a run."""

    dp: bool = Field(
        True, description="DP on: central, or distributed with secure_aggregation. Default true, but false when "
        "secure_aggregation is on and dp is not given: masks alone add no noise; say dp: true for distributed DP.",
    )
    clip_norm: float = Field(
        1.0, gt=0, le=1e6,
        description="C: each update's L2 norm over the round's sync set is clipped to C, by the participant and "
        "again by the coordinator (outer.clip_norm is taken down to C).",
    )
    noise_multiplier: float = Field(
        1.0, ge=0.01, le=1000,
        description="σ: the coordinator adds N(0, (σ·w_max·C)²) to each coordinate of the round's weighted mean, "
        "w_max the round's largest capped share (outer.max_share).",
    )
    delta: float = Field(1e-5, gt=0, le=0.1, description="δ of the reported (ε, δ); below 1 / participants.")
    epsilon_budget: float | None = Field(
        None, gt=0, le=1e6,
        description="The most ε the run may spend: a config whose planned rounds would spend more is refused "
        "(at the start and on a live change of rounds), with the ε it would reach. Unset: reported only.",
    )
    accountant: Literal["rdp", "pld"] = Field(
        "rdp", description="dp-accounting's RDP accountant, or PLD (tighter; exact for a fixed σ).")
    sampling: Literal["all", "poisson"] = Field(
        "all", description="all: every participant takes part in every round (the only one fedtrain does; "
        "poisson is refused: it needs cohort sampling).",
    )
    secure_aggregation: bool = Field(
        False, description="Secure aggregation (SecAgg, SecAgg+): participants upload masked fixed-point updates "
        "and the coordinator learns only the round's token-weighted mean. With dp on, the noise is distributed: "
        "each participant adds its share, the coordinator none (docs/privacy.md).",
    )
    secagg_threshold: int | None = Field(
        None, ge=2, le=MAX_SECAGG_PARTICIPANTS,
        description="t: the shares that rebuild a participant's secrets, and the fewest survivors a round commits "
        "with. Unset: max(2, ceil(2n/3)) of the n participants that advertised keys in the round.",
    )
    secagg_degree: int | None = Field(
        None, ge=2, le=MAX_SECAGG_PARTICIPANTS,
        description="SecAgg+ neighbours k of each participant (an odd k counts as k + 1); unset: everyone pairs "
        "with everyone.",
    )
    secagg_range: float = Field(
        1.0, gt=0, le=1e6,
        description="R: each coordinate of an update is clamped to [-R, R] before it is encoded in the ring "
        "(precision R / (2^p - 1)); with dp on it must cover the weighted update and its noise.",
    )
    secagg_max_participants: int = Field(
        64, ge=2, le=MAX_SECAGG_PARTICIPANTS,
        description="n_max: the most participants a round's secure aggregation takes; with the precision it sizes "
        "the ring (b >= ceil(log2 n_max) + p + 1).",
    )
    secagg_ring_bits: Literal[16, 32] | None = Field(
        None, description="The ring 2^16 (2 bytes a parameter) or 2^32 (4); unset: the smallest that holds "
        "n_max at secagg_precision_bits, every spare bit spent on precision.",
    )
    secagg_precision_bits: int = Field(
        7, ge=1, le=30, description="The fewest bits of precision p an encoded value has (7: int8's).")
    secagg_phase_timeout_s: float = Field(
        30.0, gt=0, le=3600,
        description="Each phase of a round's secure aggregation (keys once at least t advertised, shares, "
        "reveal) closes when everyone expected has answered or after this long.",
    )


    @model_validator(mode="before")
    @classmethod
    def _secure_aggregation_alone(cls, data: Any) -> Any:
        """`secure_aggregation: true` without `dp`: secure aggregation alone, no noise. A user who
        asks for masks does not expect σ = 1 of noise on every round; DP is asked for by name."""
        if isinstance(data, dict) and data.get("secure_aggregation") is True and "dp" not in data:
            return {**data, "dp": False}
        return data


def dp_on(cfg: Any) -> bool:
    """Whether the run config `cfg` has DP on (central, or distributed with secure aggregation)."""
    p = getattr(cfg, "privacy", None)
    return p is not None and p.dp


def secagg_on(cfg: Any) -> bool:
    """Whether the run config `cfg` has secure aggregation on."""
    p = getattr(cfg, "privacy", None)
    return p is not None and p.secure_aggregation


def central_dp_on(cfg: Any) -> bool:
    """Whether the coordinator adds the noise (DP on without secure aggregation)."""
    return dp_on(cfg) and not secagg_on(cfg)


def check_privacy(cfg: Any) -> None:
    """Raise ValueError (the config's validation error) for a config central DP cannot compose
    with, or whose planned rounds spend more than the ε budget; take `outer.clip_norm` down to C
    (the coordinator's clip, which the guarantee rests on)."""
    if secagg_on(cfg):
        why = _secagg_refusal(cfg, cfg.privacy)
        if why is not None:
            raise ValueError(f"privacy.secure_aggregation {why}")
    if not dp_on(cfg):
        return
    p: PrivacyConfig = cfg.privacy
    outer = cfg.outer
    why = _refusal(cfg, p)
    if why is not None:
        raise ValueError(f"privacy ({'distributed' if p.secure_aggregation else 'central'} DP) {why}")
    if not p.secure_aggregation and (outer.clip_norm is None or outer.clip_norm > p.clip_norm):
        outer.clip_norm = p.clip_norm  # (masked updates: each participant clips its own; no one can check)
    if p.epsilon_budget is not None:
        from fedtrain.privacy.central import budget_refusal

        try:
            refusal = budget_refusal(p, cfg.rounds)
        except ConfigError:  # dp-accounting missing: a participant's copy of the config, which
            return           # needs no accountant; the coordinator checks again at its start (CentralDp)
        if refusal is not None:
            raise ValueError(f"privacy.epsilon_budget: {refusal}")


def _refusal(cfg: Any, p: PrivacyConfig) -> str | None:
    outer = cfg.outer
    if cfg.schedule.mode == "async":
        return ("cannot be used with schedule.mode async: every version is one participant's update alone, applied "
                "at its own pace, so the noise and the accounting would be per applied update and per participant, "
                "not per round; use rounds or balanced")
    if outer.aggregator != "mean":
        return (f"cannot be used with outer.aggregator {outer.aggregator}: the sensitivity w_max·C bounds how far one "
                "clipped update moves a weighted mean, not a coordinate-wise median or trimmed mean; use mean")
    if outer.outlier_factor is not None:
        return ("cannot be used with outer.outlier_factor: leaving an update out by the round's median norm lets one "
                "participant's update decide another's inclusion, beyond the sensitivity w_max·C; unset it")
    if cfg.late_uploads == "fold":
        return ("needs late_uploads refuse: a late update folded into the next round could meet its participant's "
                "next update there, a contribution of up to twice its share·C")
    if p.sampling == "poisson":
        return ("sampling poisson is refused: fedtrain does not sample a cohort per round, so the amplification "
                "Poisson sampling gives would be claimed for a sampling that never happened; use all")
    if p.epsilon_budget is not None and cfg.rounds == 0:
        from fedtrain.privacy.central import rounds_within

        return ("epsilon_budget needs a planned end: rounds 0 (no end) cannot be checked against the budget before "
                f"the run starts; set rounds ({rounds_within(p)})")
    if not math.isfinite(p.clip_norm * p.noise_multiplier):
        return "needs a finite σ·C"
    return None


def _secagg_refusal(cfg: Any, p: PrivacyConfig) -> str | None:
    """Why secure aggregation cannot run with `cfg` (None: it can)."""
    outer, train = cfg.outer, cfg.train
    if cfg.schedule.mode == "async":
        return ("cannot be used with schedule.mode async: each version applies one update alone, and the sum of one "
                "masked update is that update; use rounds or balanced")
    if outer.aggregator != "mean":
        return (f"cannot be used with outer.aggregator {outer.aggregator}: a coordinate-wise median or trimmed mean "
                "needs every update's values, and masked updates show only their sum; use mean")
    if outer.outlier_factor is not None:
        return ("cannot be used with outer.outlier_factor: one masked update's norm is hidden from the coordinator, "
                "so it cannot be left out by it; unset it")
    if outer.clip_norm is not None and not p.dp:
        return ("cannot be used with outer.clip_norm: the coordinator cannot see one masked update's norm to clip it "
                "(with dp on, each participant clips its own to privacy.clip_norm); unset it")
    if cfg.late_uploads == "fold":
        return ("needs late_uploads refuse: a late update is masked for a round whose masks are gone, so it cannot "
                "be folded into the next one")
    if train.compression in ("topk", "e3m0", "int2", "ternary", "int1"):
        return (f"cannot be used with train.compression {train.compression}: "
                + ("masks make every entry of an update dense, and each participant's support would show"
                   if train.compression == "topk" else
                   "each participant's private block scales make the codes add up to nothing")
                + "; use none or int8 (the update is encoded on the ring's public grid either way)")
    if p.secagg_threshold is not None and p.secagg_threshold > p.secagg_max_participants:
        return (f"needs secagg_threshold ({p.secagg_threshold}) at most secagg_max_participants "
                f"({p.secagg_max_participants})")
    if p.secagg_degree is not None and p.secagg_threshold is not None and p.secagg_degree + 1 < p.secagg_threshold:
        return (f"needs secagg_threshold ({p.secagg_threshold}) at most secagg_degree + 1 ({p.secagg_degree + 1}): "
                "each secret has only the participant and its neighbours as holders")
    from fedtrain.privacy.ring import FixedPoint

    try:
        FixedPoint.plan(p.secagg_max_participants, p.secagg_range, p.secagg_precision_bits, p.secagg_ring_bits)
    except ConfigError as e:
        return f"ring: {e.message}"
    return None
