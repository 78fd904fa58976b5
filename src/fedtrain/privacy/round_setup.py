"""The public parameters of one secure-aggregation round, the same for the coordinator and every participant."""

from __future__ import annotations

from dataclasses import dataclass

from fedtrain.privacy.failures import PrivacyError
from fedtrain.privacy.keys import RoundTag
from fedtrain.privacy.ring import FixedPoint


@dataclass(frozen=True)
class RoundSetup:
    """`tag` separates this round's secrets from every other's; `fixed_point` is the ring and
    encoding; `threshold` t is the shares needed to rebuild a secret, of its k + 1 holders (the
    participant and its k neighbours; Bonawitz et al. ask t > n/2 with full pairing); `degree` k
    the SecAgg+ neighbours (None: everyone); `graph_seed` the public seed of the pairing graph
    (the coordinator draws it fresh each round and announces it)."""

    tag: RoundTag
    fixed_point: FixedPoint
    threshold: int
    degree: int | None = None
    graph_seed: bytes = b"\0" * 16

    def __post_init__(self) -> None:
        if self.threshold < 2:
            raise PrivacyError(f"the share threshold must be at least 2, got {self.threshold}")
        if self.degree is not None and self.degree + 1 < self.threshold:
            raise PrivacyError(
                f"each secret needs t = {self.threshold} holders, more than the participant "
                f"and its {self.degree} neighbours"
            )
