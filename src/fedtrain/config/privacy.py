"""The run config's `privacy` section (central differential privacy, issue #33) and what it needs
of the rest of the config; the compositions that cannot work are refused here, each with its reason.

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

from pydantic import Field

from fedtrain.config.sections import Strict
from fedtrain.errors import ConfigError

#: Reason shown for a live change of the privacy section (config/changes.py FIXED_FIELDS).
FIXED_REASON = ("the accountant composes every committed round with the σ, C and δ in force from the start: a "
                "change mid-run would make the reported ε wrong")


class PrivacyConfig(Strict):
    """Central differential privacy (docs/privacy.md): clipping, Gaussian noise at the coordinator and
    an (ε, δ) accountant. Fixed for the life of a run."""

    dp: bool = Field(True, description="Central DP on (the section null, or dp false: off).")
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


def dp_on(cfg: Any) -> bool:
    """Whether the run config `cfg` has central DP on."""
    p = getattr(cfg, "privacy", None)
    return p is not None and p.dp


def check_privacy(cfg: Any) -> None:
    """Raise ValueError (the config's validation error) for a config central DP cannot compose
    with, or whose planned rounds spend more than the ε budget; take `outer.clip_norm` down to C
    (the coordinator's clip, which the guarantee rests on)."""
    if not dp_on(cfg):
        return
    p: PrivacyConfig = cfg.privacy
    outer = cfg.outer
    why = _refusal(cfg, p)
    if why is not None:
        raise ValueError(f"privacy (central DP) {why}")
    if outer.clip_norm is None or outer.clip_norm > p.clip_norm:
        outer.clip_norm = p.clip_norm
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
