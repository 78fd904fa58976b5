"""Key agreement and the share channel: both ends derive one secret per pair, round, run and
purpose; the coordinator's directory holds public keys only; sealed bundles open only for their
recipient in their round."""

from __future__ import annotations

import inspect

import pytest

from fedtrain.privacy.failures import PrivacyError
from fedtrain.privacy.keys import KeyDirectory, ParticipantKeys, PublicKeys, RoundTag, pair_seed_from_private
from fedtrain.privacy.shamir import split
from fedtrain.privacy.shares import ShareBundle, open_sealed, seal

TAG = RoundTag("run-a", 7)


def test_both_ends_derive_the_same_pair_seed_and_channel_key() -> None:
    a, b = ParticipantKeys.generate(3), ParticipantKeys.generate(11)
    assert a.pair_seed(TAG, 11, b.public()) == b.pair_seed(TAG, 3, a.public())
    assert a.channel_key(TAG, 11, b.public()) == b.channel_key(TAG, 3, a.public())
    assert a.pair_seed(TAG, 11, b.public()) != a.channel_key(TAG, 11, b.public())


def test_secrets_are_domain_separated_by_round_run_and_pair() -> None:
    a, b, c = (ParticipantKeys.generate(i) for i in (1, 2, 3))
    base = a.pair_seed(TAG, 2, b.public())
    assert base != a.pair_seed(RoundTag("run-a", 8), 2, b.public())
    assert base != a.pair_seed(RoundTag("run-b", 7), 2, b.public())
    assert base != a.pair_seed(TAG, 3, c.public())
    # the ids enter the derivation: the same keys claimed under other ids give another seed
    assert base != a.pair_seed(TAG, 5, b.public())


def test_a_dropped_participants_seed_rebuilt_from_its_private_key() -> None:
    d, u = ParticipantKeys.generate(4), ParticipantKeys.generate(9)
    rebuilt = pair_seed_from_private(d.mask_private_bytes(), TAG, 4, 9, u.public())
    assert rebuilt == u.pair_seed(TAG, 4, d.public())


def test_the_directory_holds_public_keys_only() -> None:
    directory = KeyDirectory()
    keys = ParticipantKeys.generate(1)
    directory.add(1, keys.public())
    assert directory.get(1) == keys.public() and directory.participants() == [1]
    # its whole surface takes and gives PublicKeys: no parameter could carry a private key
    methods = inspect.getmembers(KeyDirectory, inspect.isfunction)
    params = [p for _, m in methods for p in inspect.signature(m).parameters]
    assert set(params) <= {"self", "participant", "keys"}
    with pytest.raises(PrivacyError, match="already"):
        directory.add(1, ParticipantKeys.generate(1).public())
    with pytest.raises(PrivacyError, match="another participant"):
        directory.add(2, keys.public())
    with pytest.raises(PrivacyError):
        directory.get(5)


@pytest.mark.parametrize("bad", [0, -1, 2**31, True, "3"])
def test_participant_ids_are_bounded_integers(bad: object) -> None:
    with pytest.raises(PrivacyError):
        ParticipantKeys.generate(bad)  # type: ignore[arg-type]


def test_public_keys_are_checked_and_travel_as_json() -> None:
    pk = ParticipantKeys.generate(1).public()
    assert PublicKeys.from_json(pk.to_json()) == pk
    for bad in ({"mask": "00"}, {"mask": "zz", "channel": "00"}, {}):
        with pytest.raises(PrivacyError):
            PublicKeys.from_json(bad)
    with pytest.raises(PrivacyError):
        PublicKeys(pk.mask, pk.mask)
    with pytest.raises(PrivacyError, match="unusable"):
        ParticipantKeys.generate(1).pair_seed(TAG, 2, PublicKeys(bytes(32), pk.channel))  # a low-order point


def _bundle(sender: int, recipient: int) -> ShareBundle:
    key = split(b"k" * 32, [recipient, 99], 2)[recipient]
    seed = split(b"s" * 32, [recipient, 99], 2)[recipient]
    return ShareBundle(sender, recipient, key, seed)


def test_a_sealed_bundle_opens_only_for_its_recipient_in_its_round() -> None:
    a, b = ParticipantKeys.generate(1), ParticipantKeys.generate(2)
    bundle = _bundle(1, 2)
    blob = seal(bundle, a.channel_key(TAG, 2, b.public()), TAG)
    key_b = b.channel_key(TAG, 1, a.public())
    assert open_sealed(blob, key_b, TAG, 1, 2) == bundle
    with pytest.raises(PrivacyError, match="authentication"):
        open_sealed(blob, key_b, RoundTag("run-a", 8), 1, 2)  # replayed into another round
    with pytest.raises(PrivacyError, match="authentication"):
        open_sealed(blob, key_b, TAG, 2, 1)  # sent back the other way
    tampered = bytearray(blob)
    tampered[20] ^= 1
    with pytest.raises(PrivacyError, match="authentication"):
        open_sealed(bytes(tampered), key_b, TAG, 1, 2)
    with pytest.raises(PrivacyError, match="bytes"):
        open_sealed(blob[:-1], key_b, TAG, 1, 2)
    # the coordinator sees the blob but not the secret shares in it
    assert bundle.key_share.to_bytes() not in blob and bundle.seed_share.to_bytes() not in blob
