"""The coordinator's side of one secure-aggregation round: relay keys and sealed shares, sum the
masked uploads, and unmask the survivors' aggregate at the close.

It holds public keys, opaque sealed blobs, ring sums and — at the close — the secrets the
survivors' shares rebuild (the survivors' self seeds, the dropped ones' mask keys), and nothing
else: no private key of a participant that uploaded and no pairwise secret between two of them.

Phases, each closed by the caller (the round's policy decides when, as today):
    advertise  → directory(), graph()         participants that sent keys: U0
    post_shares → mailbox(v), sharing()       participants that sent shares: U1 ⊆ U0
    add_upload  → unmask_request()            survivors U2 ⊆ U1 (complete uploads), dropped U1 \\ U2
    post_reveal → finish(weights)             refused (NotEnoughShares) below t survivors or shares
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch

from fedtrain.privacy.failures import PrivacyError
from fedtrain.privacy.keys import KeyDirectory, PublicKeys
from fedtrain.privacy.masks import pairing_graph
from fedtrain.privacy.round_setup import RoundSetup
from fedtrain.privacy.shares import SEALED_BYTES
from fedtrain.privacy.unmask import MaskedSum, RevealedShare, recover, unmask_aggregate


class SecAggCoordinator:
    """One round's relay and accumulator. `shapes` is the synced tensors' names and shapes."""

    def __init__(self, setup: RoundSetup, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.setup = setup
        self._shapes = {name: tuple(s) for name, s in shapes.items()}
        self._keys = KeyDirectory()
        self._graph: dict[int, frozenset[int]] | None = None
        self._mail: dict[int, dict[int, bytes]] = {}
        self._sharing: set[int] = set()
        self._sum = MaskedSum(setup.fixed_point, {n: int(np.prod(s)) for n, s in self._shapes.items()})
        self._revealed: dict[int, list[RevealedShare]] = {}

    def advertise(self, participant: int, keys: PublicKeys) -> None:
        if self._graph is not None:
            raise PrivacyError("key advertisement is closed for this round")
        self._keys.add(participant, keys)

    def directory(self) -> dict[int, PublicKeys]:
        """Closes advertisement (the participant set U0 is fixed) and returns what is broadcast."""
        self.graph()
        return self._keys.snapshot()

    def graph(self) -> dict[int, frozenset[int]]:
        if self._graph is None:
            self._graph = pairing_graph(self._keys.participants(), self.setup.degree, self.setup.graph_seed)
        return self._graph

    def post_shares(self, sender: int, sealed: Mapping[int, bytes]) -> None:
        """Store a participant's sealed bundles for relay; one post per participant, to its neighbours only."""
        graph = self.graph()
        if sender not in graph:
            raise PrivacyError(f"participant {sender} advertised no keys this round")
        if sender in self._sharing:
            raise PrivacyError(f"participant {sender} already posted its shares")
        if set(sealed) != set(graph[sender]):
            raise PrivacyError(
                f"participant {sender} must send one bundle to each of its {len(graph[sender])} neighbours"
            )
        if any(len(b) != SEALED_BYTES for b in sealed.values()):
            raise PrivacyError(f"a sealed bundle is {SEALED_BYTES} bytes")
        for recipient, blob in sealed.items():
            self._mail.setdefault(recipient, {})[sender] = blob
        self._sharing.add(sender)

    def mailbox(self, recipient: int) -> dict[int, bytes]:
        return dict(self._mail.get(recipient, {}))

    def sharing(self) -> frozenset[int]:
        """U1: the participants whose shares went out, and so the ones everyone pairs with."""
        return frozenset(self._sharing)

    def add_upload(self, participant: int, tensors: Iterable[tuple[str, np.ndarray]]) -> None:
        if participant not in self._sharing:
            raise PrivacyError(f"participant {participant} shared no keys: its masks could not be removed")
        self._sum.add_upload(participant, tensors)

    def unmask_request(self) -> tuple[frozenset[int], frozenset[int]]:
        """(survivors, dropped): what every survivor is asked to reveal shares for."""
        alive = self._sum.contributors()
        return alive, frozenset(self._sharing - alive)

    def post_reveal(self, participant: int, shares: list[RevealedShare]) -> None:
        if participant in self._revealed:
            raise PrivacyError(f"participant {participant} already revealed its shares")
        self._revealed[participant] = list(shares)

    def finish(self, weights: Mapping[int, float], workers: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
        """The survivors' token-weighted mean, tensor by tensor (consumes the ring sums); `workers`
        threads draw the masks to remove."""
        alive, _ = self.unmask_request()
        recovered = recover(
            self.setup.tag, self.setup.threshold, self._keys.snapshot(), self.graph(),
            self._sharing, alive, self._revealed,
        )
        return unmask_aggregate(self._sum.sums(), self._shapes, recovered, weights, self.setup.fixed_point, workers)
