"""The quality study's links and privacy (`quality_sim.py`): compressed uploads, compressed
downloads with the coordinator's error feedback, and central DP, each the library's own code.

- `Uplink`: one participant's upload: `fedtrain.wire.compress` with the run's `Codec` (int8,
  e3m0, or topk at a density and bits), optionally through the participant's `ErrorFeedback`;
  bytes are `EncodedBody(...).content_length` of the compressed body, and the Δ the
  coordinator merges is what it decodes.
- `Downlink`: the coordinator's published model P and its residual E (an `ErrorFeedback` on
  the server side): after the outer step gives G from P, D = G − P + E, C = compress(D),
  P ← P + decompress(C), E ← D − decompress(C); every participant, and the next outer step,
  start from P. Bytes: the compressed delta's body. Without a download codec every
  participant downloads the whole fp32 model, as the coordinator serves it.
- `Privacy`: central DP as the coordinator runs it (`fedtrain.privacy.central.CentralDp`):
  each participant's Δ clipped to C (`clip_update`, over the whole model), N(0, σ·w_max·C)
  added to each coordinate of the weighted mean (`add_noise_to_sum`), ε from the accountant
  for the rounds merged (`run_epsilon`). The noise comes from a seeded generator, so that a
  rerun gives the same losses (the coordinator seeds it from the OS CSPRNG).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from fedtrain.participant.engine.momentum import LocalMomentum
from fedtrain.privacy.clipping import clip_update, l2_norm
from fedtrain.wire import EncodedBody
from fedtrain.wire.compress import DEFAULT_CHUNK, Codec, ErrorFeedback, compress, decompress

if TYPE_CHECKING:
    from quality_sim import Method

NOISE_SEED = 4242  # the study's noise generator (the coordinator draws its seed from the OS CSPRNG)


def codec_of(method: Method) -> Codec:
    """The run's upload (and download) codec: topk's k per chunk from its density, as
    `Codec.for_train` computes it from `train.topk_density`."""
    if method.compression != "topk":
        return Codec(method.compression, method.block, deflate=method.deflate, bf16_scales=method.bf16_scales)
    k = max(1, min(DEFAULT_CHUNK, round(method.density * DEFAULT_CHUNK)))
    return Codec("topk", k=k, chunk=DEFAULT_CHUNK, bits=method.bits)


def _shapes(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in tensors.items()}


def full_body_bytes(params: Mapping[str, torch.Tensor], version: int) -> int:
    """The whole model as the coordinator serves it: fp32 safetensors with its version."""
    return EncodedBody(params, {"version": str(version)}).content_length


class Uplink:
    """One participant's uploads: (bytes on the wire, Δ as the coordinator decodes it)."""

    def __init__(self, codec: Codec, feedback: bool, decay: float = 1.0, momentum: float = 0.0) -> None:
        self.codec = codec
        self.feedback = ErrorFeedback(decay) if feedback and codec.scheme != "none" else None
        self.momentum = momentum  # the participant's own Nesterov before compression (`LocalMomentum`)
        self.local = LocalMomentum()

    def send(self, delta: dict[str, torch.Tensor]) -> tuple[int, dict[str, torch.Tensor]]:
        if self.momentum:
            delta = self.local.step(delta, self.momentum, nesterov=True)
        if self.codec.scheme == "none":
            return EncodedBody(delta).content_length, delta
        if self.feedback is not None:
            tensors, meta = self.feedback.compress(delta, self.codec)
        else:
            tensors, meta = compress(delta, self.codec)
        decoded = dict(decompress(tensors.items(), meta, shapes=_shapes(delta)))
        return EncodedBody(tensors, meta).content_length, decoded


class Downlink:
    """The published model P (what every participant holds) and the server's residual E."""

    def __init__(self, codec: Codec | None, params: Mapping[str, torch.Tensor]) -> None:
        self.codec = codec  # None: every download is the whole fp32 model (P is G: nothing to keep)
        self.published = {n: t.detach().clone() for n, t in params.items()} if codec is not None else {}
        self.feedback = ErrorFeedback()
        self.version = 0

    @property
    def residual(self) -> dict[str, torch.Tensor]:
        return self.feedback.residual

    @torch.no_grad()
    def publish(self, target: dict[str, torch.Tensor]) -> int:
        """Publish the outer step's result `target` (G, some or all of the tensors): P moves by
        decompress(compress(G − P + E)), then `target` is set to P, so that the next outer step
        starts from what was sent. Returns the bytes one participant downloads."""
        self.version += 1
        if self.codec is None:
            return full_body_bytes(target, self.version)
        diff = {n: t - self.published[n] for n, t in target.items()}
        tensors, meta = self.feedback.compress(diff, self.codec)
        for n, sent in decompress(tensors.items(), meta, shapes=_shapes(diff)):
            self.published[n].add_(sent)
            target[n].copy_(self.published[n])
        meta = {**meta, "version": str(self.version)}
        return EncodedBody(tensors, meta).content_length


class Privacy:
    """Central DP of one run: clip each Δ to C, noise the weighted mean, ε for the rounds merged.
    σ = 0: clipping only (no noise, no ε)."""

    def __init__(self, clip: float, noise: float, planned_rounds: int, delta: float = 1e-5) -> None:
        self.clip, self.noise, self.delta = clip, noise, delta
        self.rounds = 0
        self.norms: list[float] = []  # every Δ's L2 norm before clipping
        self.clipped = 0
        self.generator = torch.Generator().manual_seed(NOISE_SEED)
        self.dp: Any = None
        if noise > 0:
            from fedtrain.config.privacy import PrivacyConfig
            from fedtrain.privacy.central import CentralDp

            self.config = PrivacyConfig(clip_norm=clip, noise_multiplier=noise, delta=delta, accountant="pld")
            self.dp = CentralDp(self.config.model_copy(update={"accountant": "rdp"}), planned_rounds)

    def clip_delta(self, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        clipped, norm = clip_update(delta, self.clip)
        self.norms.append(norm)
        self.clipped += norm > self.clip
        return clipped

    def noise_mean(self, mean: dict[str, torch.Tensor], shares: Mapping[str, float]) -> None:
        """N(0, (σ·w_max·C)²) on each coordinate of the mean, in place (`CentralDp.noise_std`)."""
        self.rounds += 1
        if self.dp is None:
            return
        from fedtrain.privacy.central import add_noise_to_sum

        add_noise_to_sum(mean, 1.0, self.dp.noise_std(shares), self.generator)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"clip": self.clip, "noise": self.noise, "clipped_share": self.clipped / max(
            1, len(self.norms)), "dp_rounds": self.rounds}
        if self.dp is not None:
            from fedtrain.privacy.central import run_epsilon, settings_of

            for acc in ("pld", "rdp"):
                p = self.config.model_copy(update={"accountant": acc})
                eps, used = run_epsilon(settings_of(p, self.rounds), self.rounds)
                out[f"epsilon_{acc}"] = eps if math.isfinite(eps) else None
                out[f"epsilon_{acc}_by"] = used
            out["delta"] = self.delta
        return out


def norm_summary(norms: list[float]) -> dict[str, float]:
    """Quantiles of Δ norms (for choosing C)."""
    if not norms:
        return {}
    t = torch.tensor(norms, dtype=torch.float64)
    qs = torch.quantile(t, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    return {"p10": qs[0], "median": qs[1], "p90": qs[2], "max": float(t.max())}


def delta_norm(delta: Mapping[str, torch.Tensor]) -> float:
    return l2_norm(delta)
