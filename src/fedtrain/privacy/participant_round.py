"""A participant's side of one secure-aggregation round (Bonawitz et al. 2017, honest-but-curious):

    1. advertise()            fresh X25519 mask and channel public keys
    2. share(directory)       split its mask private key and a fresh self seed among itself and its
                              k neighbours (t of k + 1; it keeps its own share), sealed per
                              recipient → blobs for the coordinator to relay
    3. receive(mailbox)       open the blobs addressed to it, keep the shares
    4. mask_tensor / mask     weighted, clipped, fixed-point update + self mask ± pairwise masks
                              (`precompute` draws the masks ahead, during the inner steps)
    5. reveal(survivors, dropped)   shares of the survivors' self seeds and the dropped ones' mask
                              keys — never both for one participant, and one answer per round

With distributed DP, step 4 takes `clipping.private_contribution(update, w, C, std)` (already
weighted, clipped and noised) with weight 1.0, so the noise is not scaled by the weight.

Step 5's rules are what keep an honest-but-curious coordinator from unmasking a single upload:
it would need both b_u and u's mask key, and a participant gives out at most one of the two for
each u, and only once.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedtrain.privacy.failures import NotEnoughShares, PrivacyError
from fedtrain.privacy.keys import ParticipantKeys, PublicKeys
from fedtrain.privacy.masks import SEED_BYTES, check_labels, mask_tensor, pairing_graph
from fedtrain.privacy.ring import FixedPoint, ring_add
from fedtrain.privacy.round_setup import RoundSetup
from fedtrain.privacy.shamir import split
from fedtrain.privacy.shares import ShareBundle, open_sealed, seal
from fedtrain.privacy.unmask import KEY, SEED, RevealedShare


@dataclass(frozen=True)
class GroupMasks:
    """Participant `me`'s seeds of one round, as its FSDP ranks hold them: each rank masks the rows
    it holds of each tensor with the same streams at the rows' element offsets, so the pieces
    together are exactly the upload the participant would have masked whole."""

    me: int
    fixed_point: FixedPoint
    self_seed: bytes
    pair_seeds: Mapping[int, bytes]

    def mask_rows(self, label: str, values: torch.Tensor, weight: float, offset: int, workers: int = 1) -> np.ndarray:
        """`weight · clamp(values)` (elements [offset, offset + numel) of tensor `label`, flat) in
        fixed point, plus the masks' slice for those elements."""
        fp = self.fixed_point
        return mask_tensor(fp.encode(values, weight), label, self.me, self.self_seed, self.pair_seeds, fp, workers,
                           offset)

    def to_json(self) -> dict[str, Any]:
        return {"me": self.me, "fixed_point": [self.fixed_point.bits, self.fixed_point.clip,
                                               self.fixed_point.precision_bits, self.fixed_point.n_max],
                "self": self.self_seed.hex(), "pairs": {str(v): s.hex() for v, s in self.pair_seeds.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GroupMasks:
        bits, clip, precision, n_max = data["fixed_point"]
        seeds = {int(v): bytes.fromhex(s) for v, s in data["pairs"].items()}
        own = bytes.fromhex(data["self"])
        if len(own) != SEED_BYTES or any(len(s) != SEED_BYTES for s in seeds.values()):
            raise PrivacyError(f"a mask seed is {SEED_BYTES} bytes")
        return cls(int(data["me"]), FixedPoint(int(bits), float(clip), int(precision), int(n_max)), own, seeds)


class SecAggParticipant:
    """One participant's state for one round; every field is set here and changed only by its steps."""

    def __init__(self, me: int, setup: RoundSetup, keys: ParticipantKeys | None = None, workers: int = 1) -> None:
        self.me = me
        self.setup = setup
        self.workers = workers  # threads that draw one tensor's masks
        self._keys = keys or ParticipantKeys.generate(me)
        self._self_seed = secrets.token_bytes(SEED_BYTES)
        self._directory: dict[int, PublicKeys] = {}
        self._neighbours: frozenset[int] = frozenset()
        self._received: dict[int, ShareBundle] = {}
        self._pair_seeds: dict[int, bytes] | None = None
        self._masked_labels: set[str] = set()
        self._premasks: dict[str, np.ndarray] = {}
        self._revealed_for: tuple[frozenset[int], frozenset[int]] | None = None

    def advertise(self) -> PublicKeys:
        return self._keys.public()

    def share(self, directory: Mapping[int, PublicKeys]) -> dict[int, bytes]:
        """Sealed share bundles, recipient → blob, for the coordinator to relay."""
        if self.me not in directory or directory[self.me] != self._keys.public():
            raise PrivacyError("the relayed key directory does not hold this participant's own keys")
        self._directory = dict(directory)
        graph = pairing_graph(directory, self.setup.degree, self.setup.graph_seed)
        self._neighbours = graph[self.me]
        holders = self._neighbours | {self.me}
        t = self.setup.threshold
        if len(holders) < t:
            raise NotEnoughShares(f"{len(holders)} share holder(s) (itself and its neighbours), fewer than t = {t}")
        key_shares = split(self._keys.mask_private_bytes(), holders, t)
        seed_shares = split(self._self_seed, holders, t)
        self._received[self.me] = ShareBundle(self.me, self.me, key_shares[self.me], seed_shares[self.me])
        tag = self.setup.tag
        return {
            v: seal(
                ShareBundle(self.me, v, key_shares[v], seed_shares[v]),
                self._keys.channel_key(tag, v, directory[v]),
                tag,
            )
            for v in sorted(self._neighbours)
        }

    def neighbours(self) -> frozenset[int]:
        return self._neighbours

    def receive(self, mailbox: Mapping[int, bytes]) -> None:
        """Open the bundles sent to this participant (sender → blob); refuses one from a non-neighbour."""
        for sender, blob in mailbox.items():
            if sender not in self._neighbours:
                raise PrivacyError(f"a share bundle from {sender}, who is not a neighbour of {self.me}")
            key = self._keys.channel_key(self.setup.tag, sender, self._directory[sender])
            self._received[sender] = open_sealed(blob, key, self.setup.tag, sender, self.me)

    def _pairs(self, sharing: Collection[int]) -> dict[int, bytes]:
        """Pairwise seeds with the neighbours that shared their keys (U1, announced by the coordinator)."""
        peers = self._neighbours & set(sharing)
        if self._pair_seeds is not None:
            if set(self._pair_seeds) != peers:
                raise PrivacyError("the set of participants that shared keys changed within the round")
            return self._pair_seeds
        if self.me not in sharing:
            raise PrivacyError(f"participant {self.me} is not among those that shared keys")
        if self.me not in self._received:
            raise PrivacyError("a participant masks only after it has shared its secrets (share())")
        missing = peers - set(self._received)  # (its own bundle is in there too, harmlessly)
        if missing:
            raise PrivacyError(f"announced as sharing but sent no shares here: {sorted(missing)}")
        tag = self.setup.tag
        self._pair_seeds = {v: self._keys.pair_seed(tag, v, self._directory[v]) for v in sorted(peers)}
        return self._pair_seeds

    def precompute(self, numels: Mapping[str, int], sharing: Collection[int]) -> None:
        """Draw the net mask (self ± pairwise) of each tensor now: masks do not depend on the update,
        so this can run during the inner steps, once shares are exchanged, and leave the upload only
        the encoding and one ring addition per tensor. Holds the masks (ring bytes per parameter)."""
        fp = self.setup.fixed_point
        pairs = self._pairs(sharing)
        for label, numel in numels.items():
            if label in self._masked_labels or label in self._premasks:
                raise PrivacyError(f"tensor {label!r} already has its mask this round")
            zeros = fp.zeros(numel)
            self._premasks[label] = mask_tensor(zeros, label, self.me, self._self_seed, pairs, fp, self.workers)

    def mask_tensor(self, label: str, values: torch.Tensor, weight: float, sharing: Collection[int]) -> np.ndarray:
        """One tensor of the upload: `weight · clamp(values)` in fixed point plus this participant's masks
        (the precomputed net mask if there is one)."""
        if label in self._masked_labels:
            raise PrivacyError(f"tensor {label!r} was already masked this round: a mask is never used twice")
        fp = self.setup.fixed_point
        encoded = fp.encode(values, weight)
        premask = self._premasks.pop(label, None)
        if premask is None:
            out = mask_tensor(encoded, label, self.me, self._self_seed, self._pairs(sharing), fp, self.workers)
        elif premask.shape != encoded.shape:
            raise PrivacyError(f"tensor {label!r} has {encoded.size} values, its precomputed mask {premask.size}")
        else:
            self._pairs(sharing)  # the same set of peers as when the mask was drawn, or refuse
            ring_add(premask, encoded)
            out = premask
        self._masked_labels.add(label)
        return out

    def mask(
        self, update: Mapping[str, torch.Tensor], weight: float, sharing: Collection[int]
    ) -> dict[str, np.ndarray]:
        check_labels(list(update))
        return {name: self.mask_tensor(name, t, weight, sharing) for name, t in update.items()}

    def group_masks(self, sharing: Collection[int]) -> GroupMasks:
        """This round's seeds (self and pairwise), for the ranks of this participant's own process
        group: an FSDP rank masks its rows with them (`GroupMasks.mask_rows`). They never leave the
        participant's processes; its own `mask` is not used after this (each mask once)."""
        if self._masked_labels or self._premasks:
            raise PrivacyError("the seeds go to the group before any tensor is masked, not after")
        return GroupMasks(self.me, self.setup.fixed_point, self._self_seed, dict(self._pairs(sharing)))

    def reveal(self, survivors: Collection[int], dropped: Collection[int]) -> list[RevealedShare]:
        """The shares the coordinator needs to unmask: self-seed shares of survivors, mask-key shares
        of dropped participants. Refuses a request that names one participant in both, that
        comes with fewer than t survivors, or that differs from an earlier request this round."""
        alive, gone = frozenset(survivors), frozenset(dropped)
        if alive & gone:
            raise PrivacyError(f"participants named both surviving and dropped: {sorted(alive & gone)}")
        if self.me not in alive:
            raise PrivacyError(f"participant {self.me} is asked to reveal but is not listed as a survivor")
        if len(alive) < self.setup.threshold:
            raise NotEnoughShares(f"{len(alive)} survivor(s), fewer than the threshold {self.setup.threshold}")
        if self._revealed_for is not None and self._revealed_for != (alive, gone):
            raise PrivacyError("a second, different unmasking request this round is refused")
        self._revealed_for = (alive, gone)
        out = []
        for owner, bundle in sorted(self._received.items()):
            if owner in alive:
                out.append(RevealedShare(owner, SEED, bundle.seed_share))
            elif owner in gone:
                out.append(RevealedShare(owner, KEY, bundle.key_share))
        return out
