"""The Shamir shares a participant sends its neighbours, sealed for the recipient.

Participant u splits two secrets among itself and its neighbours, threshold t: its mask private key
(so the coordinator can remove u's pairwise masks if u drops after the others masked) and its
self-mask seed b_u (so the coordinator can remove u's self mask if u's upload arrives). The
recipient v gets one `ShareBundle` (both shares), sealed with ChaCha20-Poly1305 under the
u–v channel key (X25519 + HKDF, `keys.py`), a random 96-bit nonce, and associated data binding
run, round, sender and recipient: the coordinator relays the blob and can neither read nor
alter it, nor replay it into another round or to another recipient.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from fedtrain.privacy.deps import crypto
from fedtrain.privacy.failures import PrivacyError
from fedtrain.privacy.keys import RoundTag
from fedtrain.privacy.shamir import SHARE_BYTES, Share

NONCE_BYTES = 12
_VERSION = 1
_HEADER = struct.Struct(">BII")
SEALED_BYTES = NONCE_BYTES + _HEADER.size + 2 * SHARE_BYTES + 16  # + the Poly1305 tag


@dataclass(frozen=True)
class ShareBundle:
    """What `sender` gives `recipient`: its share of the sender's mask key and of its self seed."""

    sender: int
    recipient: int
    key_share: Share
    seed_share: Share

    def __post_init__(self) -> None:
        if self.key_share.x != self.recipient or self.seed_share.x != self.recipient:
            raise PrivacyError("a bundle's shares must be the recipient's (x = recipient id)")


def _aad(tag: RoundTag, sender: int, recipient: int) -> bytes:
    return tag.info("share", sender, recipient) + struct.pack(">II", sender, recipient)


def seal(bundle: ShareBundle, channel_key: bytes, tag: RoundTag) -> bytes:
    crypto()
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    plain = (
        _HEADER.pack(_VERSION, bundle.sender, bundle.recipient)
        + bundle.key_share.to_bytes()
        + bundle.seed_share.to_bytes()
    )
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(channel_key).encrypt(nonce, plain, _aad(tag, bundle.sender, bundle.recipient))


def open_sealed(blob: bytes, channel_key: bytes, tag: RoundTag, sender: int, recipient: int) -> ShareBundle:
    """The bundle in `blob`, if it was sealed by `sender` for `recipient` in this round; else PrivacyError."""
    crypto()
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    if len(blob) != SEALED_BYTES:
        raise PrivacyError(f"a sealed share bundle is {SEALED_BYTES} bytes, got {len(blob)}")
    try:
        plain = ChaCha20Poly1305(channel_key).decrypt(
            blob[:NONCE_BYTES], blob[NONCE_BYTES:], _aad(tag, sender, recipient)
        )
    except InvalidTag:
        raise PrivacyError(f"the share bundle from {sender} to {recipient} fails authentication") from None
    version, s, r = _HEADER.unpack_from(plain)
    if version != _VERSION or (s, r) != (sender, recipient):
        raise PrivacyError("the share bundle's header does not match its sender and recipient")
    body = plain[_HEADER.size :]
    return ShareBundle(
        sender,
        recipient,
        Share.from_bytes(recipient, body[:SHARE_BYTES]),
        Share.from_bytes(recipient, body[SHARE_BYTES:]),
    )
