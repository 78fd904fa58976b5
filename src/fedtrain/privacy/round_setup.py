"""The public parameters of one secure-aggregation round, the same for the coordinator and every participant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedtrain.privacy.failures import PrivacyError
from fedtrain.privacy.keys import RoundTag
from fedtrain.privacy.ring import FixedPoint

#: A masked upload's safetensors metadata key: JSON {"session": <the attempt's>, "bits": 16 | 32}.
SECAGG_META = "fedtrain.secagg"


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


def setup_json(setup: RoundSetup) -> dict[str, Any]:
    fp = setup.fixed_point
    return {"run_id": setup.tag.run_id, "round": setup.tag.round, "bits": fp.bits, "range": fp.clip,
            "precision_bits": fp.precision_bits, "n_max": fp.n_max, "threshold": setup.threshold,
            "degree": setup.degree, "graph_seed": setup.graph_seed.hex()}


def setup_from_json(data: dict[str, Any]) -> RoundSetup:
    """A participant's copy of the coordinator's `setup_json` (checked again on construction)."""
    fp = FixedPoint(int(data["bits"]), float(data["range"]), int(data["precision_bits"]), int(data["n_max"]))
    degree = data.get("degree")
    return RoundSetup(RoundTag(str(data["run_id"]), int(data["round"])), fp, int(data["threshold"]),
                      int(degree) if degree is not None else None, bytes.fromhex(str(data["graph_seed"])))
