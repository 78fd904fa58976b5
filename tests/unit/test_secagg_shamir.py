"""Shamir sharing over GF(2^127 - 1): any t shares give the secret back, fewer are refused."""

from __future__ import annotations

import contextlib
import itertools
import secrets

import pytest

from fedtrain.privacy.failures import NotEnoughShares, PrivacyError
from fedtrain.privacy.shamir import SHARE_BYTES, Share, combine, split


@pytest.mark.parametrize("n, t", [(2, 2), (3, 2), (5, 3), (7, 4), (8, 8)])
def test_every_t_subset_recovers_the_secret(n: int, t: int) -> None:
    secret = secrets.token_bytes(32)
    shares = split(secret, range(1, n + 1), t)
    for subset in itertools.combinations(shares.values(), t):
        assert combine(subset, t) == secret
    assert combine(shares.values(), t) == secret  # more than t is fine too


@pytest.mark.parametrize("secret", [bytes(32), b"\xff" * 32, bytes(range(32))])
def test_edge_secrets_round_trip(secret: bytes) -> None:
    assert combine(list(split(secret, [3, 9, 1000, 2**31 - 1], 3).values())[1:], 3) == secret


def test_fewer_than_t_shares_are_refused_not_guessed() -> None:
    shares = list(split(secrets.token_bytes(32), range(1, 6), 3).values())
    with pytest.raises(NotEnoughShares, match="threshold 3"):
        combine(shares[:2], 3)
    with pytest.raises(NotEnoughShares):
        combine([shares[0], shares[0], shares[0]], 3)  # the same holder thrice is one share


def test_a_wrong_share_gives_a_different_secret_or_an_error() -> None:
    secret = secrets.token_bytes(32)
    shares = list(split(secret, range(1, 4), 2).values())
    forged = Share(shares[0].x, tuple((y + 1) % (2**127 - 1) for y in shares[0].ys))
    with contextlib.suppress(PrivacyError):  # out of range is refused, else a different secret
        assert combine([forged, shares[1]], 2) != secret
    with pytest.raises(PrivacyError, match="two different shares"):
        combine([forged, shares[0], shares[1]], 2)


def test_share_bytes_round_trip_and_bounds() -> None:
    s = split(secrets.token_bytes(32), [4, 5], 2)[4]
    assert Share.from_bytes(4, s.to_bytes()) == s and len(s.to_bytes()) == SHARE_BYTES
    with pytest.raises(PrivacyError):
        Share.from_bytes(4, b"\0" * 5)
    with pytest.raises(PrivacyError):
        split(secrets.token_bytes(31), [1, 2], 2)
    with pytest.raises(PrivacyError):
        split(secrets.token_bytes(32), [1, 2], 3)
    with pytest.raises(PrivacyError):
        split(secrets.token_bytes(32), [0, 1], 2)  # x = 0 is where the secret sits


def test_shares_of_one_secret_differ_between_splits() -> None:
    """Fresh randomness each split: t - 1 shares from two splits of one secret do not match."""
    secret = secrets.token_bytes(32)
    assert split(secret, [1, 2, 3], 2)[1] != split(secret, [1, 2, 3], 2)[1]
