"""Pairwise key agreement for secure aggregation: X25519 key pairs per participant per round,
HKDF-derived pairwise secrets, and the coordinator's directory of public keys.

Each participant makes two fresh X25519 key pairs every round (Bonawitz et al. 2017, §4):
the *mask* key, whose pairwise secrets seed the pairwise masks (and whose private half is
secret-shared, so the coordinator can remove a dropped participant's masks), and the
*channel* key, whose pairwise secrets encrypt the Shamir shares sent through the
coordinator (never shared, so reconstructing a dropped one's mask key does not open its mail).

Secrets are domain-separated by HKDF-SHA256 over (purpose, run id, round, lower id, higher id):
the two ends of a pair derive the same 32 bytes, and no two rounds, runs or purposes share one.

The coordinator's side is `KeyDirectory`: it relays public keys and has no field, argument or
method that takes a private key. `ParticipantKeys` (the private halves) lives only on a participant.
Participant ids are integers 1 … 2³¹−1 (they double as Shamir x-coordinates and order the pairs).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from fedtrain.privacy.deps import crypto
from fedtrain.privacy.failures import PrivacyError

KEY_BYTES = 32
MAX_PARTICIPANT_ID = 2**31 - 1
_SALT = b"fedtrain/secagg/v1"
MASK_PURPOSE = "mask"
CHANNEL_PURPOSE = "channel"


def check_participant_id(pid: int) -> int:
    if isinstance(pid, bool) or not isinstance(pid, int) or not 1 <= pid <= MAX_PARTICIPANT_ID:
        raise PrivacyError(f"participant ids are integers 1..{MAX_PARTICIPANT_ID}, got {pid!r}")
    return pid


@dataclass(frozen=True)
class RoundTag:
    """What makes one round's secrets different from every other's: the run and the round number."""

    run_id: str
    round: int

    def __post_init__(self) -> None:
        if not self.run_id or len(self.run_id.encode()) > 256:
            raise PrivacyError("run_id must be 1..256 bytes")
        if self.round < 0:
            raise PrivacyError(f"round must be >= 0, got {self.round}")

    def info(self, purpose: str, a: int, b: int) -> bytes:
        """HKDF info for the pair {a, b}: length-prefixed fields, ids in order, so it is unambiguous
        and the same at both ends."""
        lo, hi = sorted((check_participant_id(a), check_participant_id(b)))
        if lo == hi:
            raise PrivacyError(f"a participant has no pairwise secret with itself (id {lo})")
        run = self.run_id.encode()
        p = purpose.encode()
        return struct.pack(f">H{len(p)}sH{len(run)}sQII", len(p), p, len(run), run, self.round, lo, hi)


def _hkdf(shared: bytes, info: bytes) -> bytes:
    c = crypto()
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=c.hashes.SHA256(), length=KEY_BYTES, salt=_SALT, info=info).derive(shared)


def _exchange(private: Any, peer_public: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

    try:
        return bytes(private.exchange(X25519PublicKey.from_public_bytes(peer_public)))
    except ValueError as exc:  # a low-order point gives an all-zero secret: refuse it
        raise PrivacyError(f"unusable peer public key: {exc}") from exc


def derive_pair_secret(private: Any, peer_public: bytes, tag: RoundTag, purpose: str, me: int, peer: int) -> bytes:
    """32 bytes that only `me` and `peer` can compute: HKDF(X25519(private, peer_public), info)."""
    return _hkdf(_exchange(private, peer_public), tag.info(purpose, me, peer))


@dataclass(frozen=True)
class PublicKeys:
    """The two public keys a participant advertises for a round (raw 32-byte X25519)."""

    mask: bytes
    channel: bytes

    def __post_init__(self) -> None:
        for name in ("mask", "channel"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != KEY_BYTES:
                raise PrivacyError(f"{name} public key must be {KEY_BYTES} raw bytes")
        if self.mask == self.channel:
            raise PrivacyError("the mask and channel public keys must differ")

    def to_json(self) -> dict[str, str]:
        return {"mask": self.mask.hex(), "channel": self.channel.hex()}

    @classmethod
    def from_json(cls, data: dict[str, str]) -> PublicKeys:
        try:
            return cls(bytes.fromhex(data["mask"]), bytes.fromhex(data["channel"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise PrivacyError(f"public keys must be {{'mask': hex, 'channel': hex}}: {exc}") from exc


class ParticipantKeys:
    """One participant's private keys for one round. Lives on the participant only: it is the one
    object that can derive pairwise secrets, and `mask_private_bytes` is what it secret-shares."""

    def __init__(self, participant: int, mask_private: Any, channel_private: Any) -> None:
        self.participant = check_participant_id(participant)
        self._mask = mask_private
        self._channel = channel_private

    @classmethod
    def generate(cls, participant: int) -> ParticipantKeys:
        crypto()
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

        return cls(participant, X25519PrivateKey.generate(), X25519PrivateKey.generate())

    def public(self) -> PublicKeys:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        raw = (Encoding.Raw, PublicFormat.Raw)
        return PublicKeys(self._mask.public_key().public_bytes(*raw), self._channel.public_key().public_bytes(*raw))

    def mask_private_bytes(self) -> bytes:
        """The raw mask private key: secret-shared among the neighbours, never sent in the clear."""
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        return bytes(self._mask.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()))

    def pair_seed(self, tag: RoundTag, peer: int, peer_keys: PublicKeys) -> bytes:
        """The seed of the pairwise mask between this participant and `peer`."""
        return derive_pair_secret(self._mask, peer_keys.mask, tag, MASK_PURPOSE, self.participant, peer)

    def channel_key(self, tag: RoundTag, peer: int, peer_keys: PublicKeys) -> bytes:
        """The AEAD key of the share channel between this participant and `peer`."""
        return derive_pair_secret(self._channel, peer_keys.channel, tag, CHANNEL_PURPOSE, self.participant, peer)


def pair_seed_from_private(mask_private: bytes, tag: RoundTag, me: int, peer: int, peer_keys: PublicKeys) -> bytes:
    """The pairwise mask seed of (me, peer) from `me`'s raw mask private key: what the coordinator
    computes once it has reconstructed a *dropped* participant's key from t shares."""
    crypto()
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    if len(mask_private) != KEY_BYTES:
        raise PrivacyError(f"a mask private key is {KEY_BYTES} bytes, got {len(mask_private)}")
    private = X25519PrivateKey.from_private_bytes(mask_private)
    return derive_pair_secret(private, peer_keys.mask, tag, MASK_PURPOSE, me, peer)


class KeyDirectory:
    """The coordinator's view of a round's keys: participant id → public keys, nothing else.
    It relays these to every participant; it never holds or derives a pairwise secret."""

    def __init__(self) -> None:
        self._keys: dict[int, PublicKeys] = {}

    def add(self, participant: int, keys: PublicKeys) -> None:
        check_participant_id(participant)
        if participant in self._keys:
            raise PrivacyError(f"participant {participant} already advertised its keys this round")
        seen = {k for pk in self._keys.values() for k in (pk.mask, pk.channel)}
        if keys.mask in seen or keys.channel in seen:
            raise PrivacyError(f"participant {participant} advertised a public key another participant uses")
        self._keys[participant] = keys

    def get(self, participant: int) -> PublicKeys:
        try:
            return self._keys[participant]
        except KeyError:
            raise PrivacyError(f"participant {participant} advertised no keys this round") from None

    def participants(self) -> list[int]:
        return sorted(self._keys)

    def snapshot(self) -> dict[int, PublicKeys]:
        """What the coordinator broadcasts: a copy, so a reader cannot change the directory."""
        return dict(self._keys)
