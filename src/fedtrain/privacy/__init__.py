"""Privacy between organisations: secure aggregation (masked, fixed-point updates that only sum)
and differential privacy (clipping, Gaussian noise, an (ε, δ) accountant).

Rooms: `keys` (X25519 + HKDF pairwise secrets; the coordinator's public-key directory),
`shamir` (t-of-n sharing), `shares` (sealed share bundles), `ring` (fixed point in Z_{2^b}
and the no-wrap rule), `masks` (ChaCha20 mask streams, the SecAgg+ pairing graph), `unmask`
(the coordinator's ring sum and unmasking math), `participant_round` / `coordinator_round`
(each side's steps of one round), `clipping` and `accountant` (DP). See docs/privacy.md.

Central DP is wired into runs (`central`: the round loop's `CentralDp`, the run's ε, the noise
on a round's mean; the config's `privacy` section); secure aggregation and distributed DP are
pure modules the coordinator's round and the participant's upload will call. `cryptography`
and `dp-accounting` come with the `privacy` extra and are imported only when used (a missing
one is a ConfigError naming the extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedtrain._lazy import lazy_exports

_SOURCES = {
    "fedtrain.privacy.accountant": (
        "DpSettings", "PrivacyLedger", "check_budget", "epsilon_after", "privacy_spent", "refuse_over_budget",
    ),
    "fedtrain.privacy.central": ("CentralDp", "run_epsilon"),
    "fedtrain.privacy.clipping": (
        "add_noise", "clip_update", "clip_within", "distributed_noise_ok", "distributed_std", "l2_norm", "noise_std",
        "private_contribution",
    ),
    "fedtrain.privacy.coordinator_round": ("SecAggCoordinator",),
    "fedtrain.privacy.failures": ("NotEnoughShares", "PrivacyError"),
    "fedtrain.privacy.keys": ("KeyDirectory", "ParticipantKeys", "PublicKeys", "RoundTag"),
    "fedtrain.privacy.masks": ("mask_stream", "pairing_graph"),
    "fedtrain.privacy.participant_round": ("SecAggParticipant",),
    "fedtrain.privacy.ring": ("FixedPoint", "check_ring", "max_participants", "required_ring_bits"),
    "fedtrain.privacy.round_setup": ("RoundSetup",),
    "fedtrain.privacy.unmask": ("MaskedSum", "Recovered", "RevealedShare", "recover", "unmask_aggregate"),
}

if TYPE_CHECKING:
    from fedtrain.privacy.accountant import (
        DpSettings,
        PrivacyLedger,
        check_budget,
        epsilon_after,
        privacy_spent,
        refuse_over_budget,
    )
    from fedtrain.privacy.central import CentralDp, run_epsilon
    from fedtrain.privacy.clipping import (
        add_noise,
        clip_update,
        clip_within,
        distributed_noise_ok,
        distributed_std,
        l2_norm,
        noise_std,
        private_contribution,
    )
    from fedtrain.privacy.coordinator_round import SecAggCoordinator
    from fedtrain.privacy.failures import NotEnoughShares, PrivacyError
    from fedtrain.privacy.keys import KeyDirectory, ParticipantKeys, PublicKeys, RoundTag
    from fedtrain.privacy.masks import mask_stream, pairing_graph
    from fedtrain.privacy.participant_round import SecAggParticipant
    from fedtrain.privacy.ring import FixedPoint, check_ring, max_participants, required_ring_bits
    from fedtrain.privacy.round_setup import RoundSetup
    from fedtrain.privacy.unmask import MaskedSum, Recovered, RevealedShare, recover, unmask_aggregate
else:
    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES)

__all__ = [
    "CentralDp",
    "DpSettings",
    "FixedPoint",
    "KeyDirectory",
    "MaskedSum",
    "NotEnoughShares",
    "ParticipantKeys",
    "PrivacyError",
    "PrivacyLedger",
    "PublicKeys",
    "Recovered",
    "RevealedShare",
    "RoundSetup",
    "RoundTag",
    "SecAggCoordinator",
    "SecAggParticipant",
    "add_noise",
    "check_budget",
    "check_ring",
    "clip_update",
    "clip_within",
    "distributed_noise_ok",
    "distributed_std",
    "epsilon_after",
    "l2_norm",
    "mask_stream",
    "max_participants",
    "noise_std",
    "pairing_graph",
    "privacy_spent",
    "private_contribution",
    "recover",
    "refuse_over_budget",
    "required_ring_bits",
    "run_epsilon",
    "unmask_aggregate",
]
