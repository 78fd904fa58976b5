"""What the run config's compression (`train.compression` and its fields) needs of the rest of
the config: the compositions that cannot work are refused here, each with its reason.

- topk with `outer.aggregator` median or trimmed_mean: a topk update is zero outside the
  entries it sent, so a coordinate-wise median or trimmed mean of a round's updates is zero
  nearly everywhere (each coordinate is sent by few participants); topk updates are summed.
- topk without `train.error_feedback`: every round would drop 95-99% of each update for good;
  top-k compression converges only when what was not sent is carried into the next round.
- topk (up or down) with an outer optimizer that has momentum (diloco's Nesterov, fedavgm, or
  `outer.momentum` > 0): error feedback delays most of each update by many rounds and the
  outer momentum amplifies the repeats. Measured at the tokens20 budget (docs/quality.md,
  "Bytes at the frontier and privacy at 20 tokens per parameter"): topk 1% both ways with DiLoCo's Nesterov
  step diverged (final loss 167.7), and topk 1% uploads alone stalled at 2.69 where fp32 DiLoCo
  was at 1.77; with outer SGD without momentum (fedavg, lr 1) the same presets train. SparseLoCo
  drops the outer momentum for this reason (its error feedback accumulates like momentum).

Compressed downloads (`train.download_compression`) compose with every outer algorithm,
aggregator, schedule mode, DP and Streaming DiLoCo (a round's delta holds its fragment's
tensors): the delta is taken after the outer step, of the published model (`wire/delta.py`).
A participant that is behind, joins or rejoins downloads the model whole; an FSDP rank
downloads its rows whole.

Everything else composes: e3m0, int2, ternary, int1, int8 and bf16 bodies decode to dense tensors; a topk update's
L2 norm (clip_norm, outlier_factor) is the norm of the values it sent, exactly what is merged.
"""

from __future__ import annotations

from typing import Any

#: Aggregators that need every coordinate of every update (`outer.aggregator`).
DENSE_AGGREGATORS = ("median", "trimmed_mean")


def download_notes(old: Any, new: Any) -> list[str]:
    """What a live change of `train.download_compression` implies, in words (`changes.change_notes`)."""
    a, b = old.train.download_compression, new.train.download_compression
    if a == b:
        return []
    if b == "none":
        return [f"train.download_compression {a} -> none: from the next round participants download the whole model; "
                "the coordinator drops the residual its compressed downloads held back (that part of the outer "
                "steps is not sent)"]
    if a == "none":
        return [f"train.download_compression none -> {b}: the next round's merge publishes a compressed delta; each "
                "participant downloads the model whole once more (to hold it as served), then deltas"]
    return [f"train.download_compression {a} -> {b}: from the next round's merge, the residual carried on"]


def check_compression(cfg: Any, outer_momentum: float) -> None:
    """Raise ValueError (the config's validation error) for a compression that cannot compose;
    `outer_momentum`: the run's outer momentum, its algorithm's default where unset."""
    t = cfg.train
    if t.upload_momentum > 0:
        _check_upload_momentum(cfg, outer_momentum)
    topk = [f"train.{k} topk" for k in ("compression", "download_compression") if getattr(t, k) == "topk"]
    if topk and outer_momentum > 0:
        raise ValueError(f"{' and '.join(topk)} cannot be used with an outer optimizer with momentum (outer.algorithm "
                         f"{cfg.outer.algorithm}, momentum {outer_momentum:g}): error feedback delays most of each "
                         "update by many rounds and the outer momentum amplifies the repeats (topk 1% with DiLoCo's "
                         "Nesterov step diverged in docs/quality.md's study); use outer.algorithm fedavg (outer SGD "
                         "at lr 1, no momentum, as SparseLoCo does; with train.upload_momentum each participant "
                         "applies the momentum before compressing), or outer.momentum: 0, or a dense compression "
                         "(int8, e3m0, int2, ternary, int1)")
    if t.compression != "topk":
        return
    if cfg.outer.aggregator in DENSE_AGGREGATORS:
        raise ValueError(f"train.compression topk cannot be used with outer.aggregator {cfg.outer.aggregator}: a "
                         "topk update is zero outside the entries it sent, so a coordinate-wise median or trimmed "
                         "mean of the round's updates is zero nearly everywhere; use aggregator mean (the sparse "
                         "updates are summed), or a dense compression (int8, e3m0, int2, ternary, int1)")
    if not t.error_feedback:
        raise ValueError(f"train.compression topk needs train.error_feedback: without it each round drops the "
                         f"{1 - t.topk_density:.0%} of every update that is not sent, for good")


def _check_upload_momentum(cfg: Any, outer_momentum: float) -> None:
    """`train.upload_momentum` needs an outer step without momentum (two momenta would compound),
    and is not built for DP (the coordinator clips and noises Δ, not the momentum's output) or
    secure aggregation (a masked upload is Δ itself)."""
    if outer_momentum > 0:
        raise ValueError(f"train.upload_momentum {cfg.train.upload_momentum:g} cannot be used with an outer optimizer "
                         f"with momentum (outer.algorithm {cfg.outer.algorithm}, momentum {outer_momentum:g}): the "
                         "two momenta would compound; use outer.algorithm fedavg (its lr is the outer lr)")
    p = cfg.privacy
    if p is not None and (p.dp or p.secure_aggregation):
        raise ValueError("train.upload_momentum is not built for differential privacy or secure aggregation: they "
                         "take each participant's Δ itself; set train.upload_momentum: 0")
