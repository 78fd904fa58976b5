"""Shamir secret sharing (t of n) of 32-byte secrets over the prime field GF(2¹²⁷ − 1).

A secret of 32 bytes is cut into three chunks of at most 15 bytes (120 bits < 127), each
shared with its own random polynomial of degree t − 1; a share is the polynomial values at
the holder's participant id (x = id ≥ 1, so x = 0, where the secret sits, is never handed
out). Any t shares give the secret back by Lagrange interpolation at 0; fewer than t are
refused with `NotEnoughShares` (t − 1 shares are consistent with every secret, so a guess
would be worse than useless). Randomness comes from `secrets` (the OS CSPRNG).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fedtrain.privacy.failures import NotEnoughShares, PrivacyError
from fedtrain.privacy.keys import check_participant_id

PRIME = 2**127 - 1
SECRET_BYTES = 32
_CHUNK = 15
CHUNKS = -(-SECRET_BYTES // _CHUNK)
ELEMENT_BYTES = 16
SHARE_BYTES = CHUNKS * ELEMENT_BYTES


@dataclass(frozen=True)
class Share:
    """One holder's share of one secret: its id (the x-coordinate) and one field value per chunk."""

    x: int
    ys: tuple[int, ...]

    def __post_init__(self) -> None:
        check_participant_id(self.x)
        if len(self.ys) != CHUNKS or not all(0 <= y < PRIME for y in self.ys):
            raise PrivacyError(f"a share holds {CHUNKS} field elements below 2^127 - 1")

    def to_bytes(self) -> bytes:
        return b"".join(y.to_bytes(ELEMENT_BYTES, "big") for y in self.ys)

    @classmethod
    def from_bytes(cls, x: int, data: bytes) -> Share:
        if len(data) != SHARE_BYTES:
            raise PrivacyError(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
        ys = tuple(int.from_bytes(data[i : i + ELEMENT_BYTES], "big") for i in range(0, SHARE_BYTES, ELEMENT_BYTES))
        return cls(x, ys)


def check_threshold(threshold: int, holders: int) -> None:
    if not 1 <= threshold <= holders:
        raise PrivacyError(f"threshold must be 1..{holders} (the number of share holders), got {threshold}")


def _chunks(secret: bytes) -> list[int]:
    if len(secret) != SECRET_BYTES:
        raise PrivacyError(f"Shamir shares {SECRET_BYTES}-byte secrets, got {len(secret)} bytes")
    return [int.from_bytes(secret[i : i + _CHUNK], "big") for i in range(0, SECRET_BYTES, _CHUNK)]


def split(secret: bytes, holders: Iterable[int], threshold: int) -> dict[int, Share]:
    """Shares of `secret` for each holder id; any `threshold` of them recover it."""
    xs = sorted({check_participant_id(x) for x in holders})
    check_threshold(threshold, len(xs))
    polys = [[c] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)] for c in _chunks(secret)]
    return {x: Share(x, tuple(_evaluate(p, x) for p in polys)) for x in xs}


def _evaluate(coefficients: list[int], x: int) -> int:
    acc = 0
    for c in reversed(coefficients):
        acc = (acc * x + c) % PRIME
    return acc


def combine(shares: Iterable[Share], threshold: int) -> bytes:
    """The secret from at least `threshold` shares (distinct holders); fewer is `NotEnoughShares`."""
    by_x: dict[int, Share] = {}
    for s in shares:
        if s.x in by_x and by_x[s.x] != s:
            raise PrivacyError(f"two different shares claim holder {s.x}")
        by_x[s.x] = s
    if threshold < 1:
        raise PrivacyError(f"threshold must be at least 1, got {threshold}")
    if len(by_x) < threshold:
        raise NotEnoughShares(
            f"{len(by_x)} share(s) of a secret shared with threshold {threshold}: refusing to reconstruct",
            details={"have": len(by_x), "threshold": threshold},
        )
    used = sorted(by_x.values(), key=lambda s: s.x)[:threshold]
    chunks = [_interpolate_at_zero([(s.x, s.ys[i]) for s in used]) for i in range(CHUNKS)]
    sizes = [min(_CHUNK, SECRET_BYTES - i) for i in range(0, SECRET_BYTES, _CHUNK)]
    try:
        return b"".join(c.to_bytes(n, "big") for c, n in zip(chunks, sizes, strict=True))
    except OverflowError:
        raise PrivacyError("the shares do not belong to one secret (a chunk came out out of range)") from None


def _interpolate_at_zero(points: list[tuple[int, int]]) -> int:
    total = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        total = (total + yi * num * pow(den, -1, PRIME)) % PRIME
    return total


def recover_all(shares: Mapping[int, Iterable[Share]], threshold: int) -> dict[int, bytes]:
    """`combine` for each owner → its shares; refuses (NotEnoughShares) if any owner lacks t shares."""
    return {owner: combine(list(s), threshold) for owner, s in shares.items()}
