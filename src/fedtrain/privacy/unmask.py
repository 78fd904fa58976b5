"""The coordinator's aggregation math: sum masked uploads in the ring, recover the masks that do
not cancel, and read the token-weighted mean back as float tensors. Pure, tensor by tensor.

`MaskedSum` folds complete uploads in as they arrive: one ring accumulator per tensor, so memory
is the model's size in ring elements however many participants upload. At the close,

  * for each survivor u, its self mask PRG(b_u) is subtracted (b_u rebuilt from t shares);
  * for each participant d that shared keys but did not upload, its pairwise masks with its
    surviving neighbours u are removed: u's upload holds +PRG(s_ud) if u < d, −PRG(s_ud) if u > d,
    and s_ud is derived from d's mask private key, rebuilt from t shares;
  * what remains is Σ_{u ∈ survivors} e_u, read back centred and divided by the scale and by the
    survivors' total weight (`FixedPoint.decode`).

Each of these steps needs one tensor's mask at a time (`unmask_tensor`), so the close streams too.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedtrain.privacy.failures import NotEnoughShares, PrivacyError
from fedtrain.privacy.keys import PublicKeys, RoundTag, pair_seed_from_private
from fedtrain.privacy.masks import PAIR, SELF, Term, apply_masks
from fedtrain.privacy.ring import FixedPoint, ring_add
from fedtrain.privacy.shamir import Share, combine

SEED = "seed"
KEY = "key"


@dataclass(frozen=True)
class RevealedShare:
    """A share a survivor hands the coordinator at the close: of `owner`'s self seed (a survivor)
    or of `owner`'s mask private key (a dropped participant), never both for one owner."""

    owner: int
    kind: str
    share: Share

    def __post_init__(self) -> None:
        if self.kind not in (SEED, KEY):
            raise PrivacyError(f"a revealed share is of a {SEED!r} or a {KEY!r}, got {self.kind!r}")


@dataclass(frozen=True)
class Recovered:
    """What the coordinator rebuilt at the close: each survivor's self seed, and the pairwise seed of
    each (survivor u, dropped d) pair of neighbours."""

    self_seeds: Mapping[int, bytes]
    dropped_pairs: Mapping[tuple[int, int], bytes]


class MaskedSum:
    """Ring sums of the masked uploads of one round, one accumulator per tensor."""

    def __init__(self, fp: FixedPoint, numels: Mapping[str, int]) -> None:
        self.fp = fp
        self._sums = {name: fp.zeros(n) for name, n in numels.items()}
        self._contributors: set[int] = set()
        self._broken: str | None = None

    def add_upload(self, participant: int, tensors: Iterable[tuple[str, np.ndarray]]) -> None:
        """Fold one complete upload in, tensor by tensor (e.g. read from its spooled file). An upload
        that stops half way, repeats or misses a tensor leaves the sum unusable: the round is refused."""
        if self._broken is not None:
            raise PrivacyError(f"the masked sum is unusable: {self._broken}")
        if participant in self._contributors:
            raise PrivacyError(f"participant {participant} already uploaded this round")
        seen: set[str] = set()
        try:
            for name, masked in tensors:
                acc = self._sums.get(name)
                if acc is None or name in seen:
                    raise PrivacyError(f"upload of {participant}: unexpected or repeated tensor {name!r}")
                if masked.dtype != self.fp.dtype or masked.shape != acc.shape:
                    raise PrivacyError(
                        f"upload of {participant}: tensor {name!r} must be {acc.size} {self.fp.dtype} ring values"
                    )
                ring_add(acc, masked)
                seen.add(name)
            if seen != set(self._sums):
                raise PrivacyError(f"upload of {participant} misses {len(self._sums) - len(seen)} tensor(s)")
        except Exception as exc:
            self._broken = f"participant {participant}'s upload failed half way ({exc})" if seen else None
            raise
        self._contributors.add(participant)

    def contributors(self) -> frozenset[int]:
        return frozenset(self._contributors)

    def sums(self) -> Iterator[tuple[str, np.ndarray]]:
        if self._broken is not None:
            raise PrivacyError(f"the masked sum is unusable: {self._broken}")
        yield from self._sums.items()


def recover(
    tag: RoundTag,
    threshold: int,
    directory: Mapping[int, PublicKeys],
    graph: Mapping[int, Collection[int]],
    sharing: Collection[int],
    survivors: Collection[int],
    revealed: Mapping[int, Iterable[RevealedShare]],
) -> Recovered:
    """Rebuild the survivors' self seeds and the dropped participants' pairwise seeds from the shares
    the survivors revealed (`revealed[holder]`). Refuses (NotEnoughShares) when fewer than t
    participants survive or any secret has fewer than t shares: the round is refused, not wrong."""
    alive = set(survivors)
    if not alive <= set(sharing):
        raise PrivacyError("every survivor must have shared its keys")
    if len(alive) < threshold:
        raise NotEnoughShares(f"{len(alive)} survivor(s), fewer than the threshold {threshold}: the round is refused")
    dropped = set(sharing) - alive
    pieces: dict[tuple[int, str], list[Share]] = {}
    for holder, shares in revealed.items():
        if holder not in alive:
            raise PrivacyError(f"participant {holder} did not upload: its shares are not taken")
        for r in shares:
            wanted = SEED if r.owner in alive else KEY if r.owner in dropped else None
            holds = holder == r.owner or holder in graph.get(r.owner, ())
            if r.kind != wanted or r.share.x != holder or not holds:
                raise PrivacyError(
                    f"participant {holder} revealed a share it should not hold or give ({r.owner}, {r.kind})"
                )
            pieces.setdefault((r.owner, r.kind), []).append(r.share)
    self_seeds = {u: combine(pieces.get((u, SEED), []), threshold) for u in sorted(alive)}
    pairs: dict[tuple[int, int], bytes] = {}
    for d in sorted(dropped):
        key = combine(pieces.get((d, KEY), []), threshold)
        for u in sorted(alive & set(graph[d])):
            pairs[(u, d)] = pair_seed_from_private(key, tag, d, u, directory[u])
    return Recovered(self_seeds, pairs)


def unmask_tensor(
    ring_sum: np.ndarray, label: str, recovered: Recovered, fp: FixedPoint, workers: int = 1
) -> np.ndarray:
    """Remove from one tensor's ring sum the masks that did not cancel, in place; returns it.
    `workers` threads draw the masks over block-aligned ranges of the tensor (same result)."""
    terms: list[Term] = [(seed, SELF, -1) for seed in recovered.self_seeds.values()]
    terms += [(seed, PAIR, -1 if u < d else 1) for (u, d), seed in recovered.dropped_pairs.items()]
    return apply_masks(ring_sum, terms, label, fp.bits, workers)


def unmask_aggregate(
    sums: Iterable[tuple[str, np.ndarray]],
    shapes: Mapping[str, tuple[int, ...]],
    recovered: Recovered,
    weights: Mapping[int, float],
    fp: FixedPoint,
    workers: int = 1,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float32 tensor) of the survivors' token-weighted mean, tensor by tensor. `weights` are
    the public token shares every participant masked with; the survivors' are summed to renormalise."""
    survivors = set(recovered.self_seeds)
    if not survivors <= set(weights):
        raise PrivacyError("every survivor needs its public token weight")
    total = sum(weights[u] for u in survivors)
    for name, ring_sum in sums:
        plain = unmask_tensor(ring_sum, name, recovered, fp, workers)
        yield name, fp.decode(plain, total).reshape(shapes[name])
