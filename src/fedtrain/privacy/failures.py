"""The errors of secure aggregation: a round that cannot be unmasked is refused, never answered wrong.

    FedtrainError
    └── PrivacyError            a secure-aggregation step cannot go on (bad share, bad ciphertext, ...)
        └── NotEnoughShares     fewer than t shares of a secret: reconstruction is refused

Config refusals (a ring too small for N, an ε budget that the run would exceed) are
`fedtrain.errors.ConfigError`, like every other bad config.
"""

from __future__ import annotations

from fedtrain.errors import FedtrainError


class PrivacyError(FedtrainError):
    code = "privacy_refused"


class NotEnoughShares(PrivacyError):
    code = "not_enough_shares"
