"""Secure aggregation end to end, through both sides' public steps: the masked sum equals the plain
token-weighted sum within fixed-point rounding, a participant that drops after masking leaves the
others' exact aggregate, and a round with fewer than t survivors (or shares) is refused, not wrong."""

from __future__ import annotations

import random
import secrets
from collections.abc import Collection, Mapping

import pytest
import torch

from fedtrain.privacy import (
    FixedPoint,
    NotEnoughShares,
    PrivacyError,
    RevealedShare,
    RoundSetup,
    RoundTag,
    SecAggCoordinator,
    SecAggParticipant,
)

Update = dict[str, torch.Tensor]


def _setup(n: int, *, threshold: int | None = None, degree: int | None = None, clip: float = 1.0) -> RoundSetup:
    t = threshold if threshold is not None else max(2, n // 2 + 1) if degree is None else max(2, degree // 2 + 1)
    return RoundSetup(RoundTag("run", 5), FixedPoint.plan(n, clip=clip), t, degree, secrets.token_bytes(16))


def run_round(
    setup: RoundSetup,
    updates: Mapping[int, Update],
    weights: Mapping[int, float],
    *,
    drop_after_masking: Collection[int] = (),
    drop_before_sharing: Collection[int] = (),
    silent_at_reveal: Collection[int] = (),
    precompute_for: Collection[int] = (),
) -> dict[str, torch.Tensor]:
    first = next(iter(updates.values()))
    coord = SecAggCoordinator(setup, {name: tuple(t.shape) for name, t in first.items()})
    parts = {u: SecAggParticipant(u, setup) for u in updates}
    for u, p in parts.items():
        coord.advertise(u, p.advertise())
    directory = coord.directory()
    for u, p in parts.items():
        if u not in drop_before_sharing:
            coord.post_shares(u, p.share(directory))
    for u, p in parts.items():
        if u not in drop_before_sharing:
            p.receive(coord.mailbox(u))
    sharing = coord.sharing()
    for u in sorted(sharing):
        if u in precompute_for:
            parts[u].precompute({n: t.numel() for n, t in updates[u].items()}, sharing)
        masked = parts[u].mask(updates[u], weights[u], sharing)  # it masked ...
        if u not in drop_after_masking:
            coord.add_upload(u, masked.items())  # ... but only these arrive
    survivors, dropped = coord.unmask_request()
    for u in sorted(survivors - set(silent_at_reveal)):
        coord.post_reveal(u, parts[u].reveal(survivors, dropped))
    return dict(coord.finish(weights))


def plain_mean(
    updates: Mapping[int, Update], weights: Mapping[int, float], who: Collection[int], clip: float
) -> Update:
    total = sum(weights[u] for u in who)
    names = next(iter(updates.values()))
    return {
        n: sum(weights[u] * updates[u][n].double().clamp(-clip, clip) for u in who) / total  # type: ignore[misc]
        for n in names
    }


def _tolerance(setup: RoundSetup, who: Collection[int], weights: Mapping[int, float]) -> float:
    """Each contribution rounds by at most half a unit; the sum is divided by the survivors' weight."""
    return len(who) * 0.5 / setup.fixed_point.scale / sum(weights[u] for u in who) + 1e-6


def _updates(rng: random.Random, ids: list[int], dtype: torch.dtype) -> dict[int, Update]:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    shapes = {"embed.weight": (17, 8), "block.0.bias": (8,), "head": (3, 2, 5)}
    return {u: {n: (torch.randn(s, generator=g) * 0.3).to(dtype) for n, s in shapes.items()} for u in ids}


def _weights(rng: random.Random, ids: list[int]) -> dict[int, float]:
    tokens = {u: rng.randint(100, 5000) for u in ids}
    return {u: tokens[u] / sum(tokens.values()) for u in ids}


def _inputs(seed: int, ids: list[int], **setup: int) -> tuple[RoundSetup, dict[int, Update], dict[int, float]]:
    """A round of the participants `ids`: its setup (`_setup`'s options), float32 updates and
    token weights drawn from `seed`."""
    rng = random.Random(seed)
    return _setup(len(ids), **setup), _updates(rng, ids, torch.float32), _weights(rng, ids)


@pytest.mark.parametrize("trial", range(6))
def test_masked_sum_equals_the_token_weighted_sum(trial: int) -> None:
    rng = random.Random(trial)
    n = rng.randint(2, 8)
    ids = sorted(rng.sample(range(1, 1000), n))
    dtype = [torch.float32, torch.bfloat16, torch.float16, torch.float64][trial % 4]
    setup = _setup(n)
    updates, weights = _updates(rng, ids, dtype), _weights(rng, ids)
    got = run_round(setup, updates, weights)
    want = plain_mean(updates, weights, ids, setup.fixed_point.clip)
    for name, ref in want.items():
        assert got[name].shape == ref.shape and got[name].dtype == torch.float32
        err = float((got[name].double() - ref).abs().max())
        assert err <= _tolerance(setup, ids, weights), (name, err)


def test_masking_leaves_the_callers_update_as_it_was() -> None:
    setup = _setup(2, clip=0.1)
    updates = {u: {"w": torch.full((4,), 5.0, dtype=torch.float64)} for u in (1, 2)}
    run_round(setup, updates, {1: 0.5, 2: 0.5})
    assert all(bool((up["w"] == 5.0).all()) for up in updates.values())


def test_values_past_the_range_are_clamped_not_wrapped() -> None:
    setup = _setup(3, clip=0.1)
    updates = {u: {"w": torch.full((4,), 5.0 * (-1) ** u)} for u in (1, 2, 3)}
    weights = {1: 0.2, 2: 0.3, 3: 0.5}
    got = run_round(setup, updates, weights)["w"]
    want = torch.full((4,), -0.2 * 0.1 + 0.3 * 0.1 - 0.5 * 0.1, dtype=torch.float64)
    assert torch.allclose(got.double(), want, atol=1e-4)


def assert_mean_of_alive(got: dict, setup, updates, weights, alive) -> None:  # type: ignore[no-untyped-def]
    """The round's aggregate is the plain weighted mean of the `alive` participants' updates,
    within fixed-point rounding."""
    for name, ref in plain_mean(updates, weights, alive, 1.0).items():
        assert float((got[name].double() - ref).abs().max()) <= _tolerance(setup, alive, weights)


def test_masks_drawn_ahead_give_the_same_aggregate() -> None:
    ids = [1, 2, 3, 4, 5]
    setup, updates, weights = _inputs(21, ids, threshold=3)
    got = run_round(setup, updates, weights, precompute_for=[1, 3, 4], drop_after_masking=[4])
    assert_mean_of_alive(got, setup, updates, weights, [1, 2, 3, 5])


@pytest.mark.parametrize("n, degree", [(12, 4), (15, 6)])
def test_sparse_pairing_gives_the_same_aggregate(n: int, degree: int) -> None:
    ids = list(range(1, n + 1))
    setup, updates, weights = _inputs(n, ids, degree=degree)
    got = run_round(setup, updates, weights, drop_after_masking=[ids[3]])
    alive = [u for u in ids if u != ids[3]]
    assert_mean_of_alive(got, setup, updates, weights, alive)


@pytest.mark.parametrize("dropped", [[2], [1, 4], [7]])
def test_a_participant_dropping_after_masking_leaves_the_others_exact_aggregate(dropped: list[int]) -> None:
    ids = list(range(1, 8))
    setup, updates, weights = _inputs(len(dropped), ids, threshold=3)
    got = run_round(setup, updates, weights, drop_after_masking=dropped)
    alive = [u for u in ids if u not in dropped]
    assert_mean_of_alive(got, setup, updates, weights, alive)


def test_a_participant_dropping_before_sharing_is_left_out_of_the_masks() -> None:
    ids = [1, 2, 3, 4, 5]
    setup, updates, weights = _inputs(9, ids, threshold=3)
    got = run_round(setup, updates, weights, drop_before_sharing=[3], drop_after_masking=[5])
    alive = [1, 2, 4]
    assert_mean_of_alive(got, setup, updates, weights, alive)


def test_fewer_than_t_survivors_is_refused_not_wrong() -> None:
    ids = [1, 2, 3, 4, 5]
    setup, updates, weights = _inputs(3, ids, threshold=3)
    with pytest.raises(NotEnoughShares, match="fewer than the threshold 3"):
        run_round(setup, updates, weights, drop_after_masking=[1, 2, 3])


def test_too_few_revealed_shares_is_refused_not_wrong() -> None:
    """Enough uploads, but only t - 1 survivors answer the unmasking request."""
    ids = [1, 2, 3, 4, 5, 6]
    setup, updates, weights = _inputs(4, ids, threshold=4)
    with pytest.raises(NotEnoughShares):
        run_round(setup, updates, weights, drop_after_masking=[6], silent_at_reveal=[1, 2])


def test_a_participant_never_reveals_both_secrets_of_anyone() -> None:
    """The coordinator cannot get u's self seed and then claim u dropped to get its mask key too."""
    setup = _setup(4, threshold=2)
    parts = {u: SecAggParticipant(u, setup) for u in (1, 2, 3, 4)}
    directory = {u: p.advertise() for u, p in parts.items()}
    mail: dict[int, dict[int, bytes]] = {u: {} for u in parts}
    for u, p in parts.items():
        for v, blob in p.share(directory).items():
            mail[v][u] = blob
    for u, p in parts.items():
        p.receive(mail[u])
    p1 = parts[1]
    with pytest.raises(PrivacyError, match="both"):
        p1.reveal({1, 2, 3}, {3, 4})
    shares = p1.reveal({1, 2, 3}, {4})
    assert {(s.owner, s.kind) for s in shares} == {(1, "seed"), (2, "seed"), (3, "seed"), (4, "key")}
    assert p1.reveal({1, 2, 3}, {4}) == shares  # asked again the same: the same answer
    with pytest.raises(PrivacyError, match="second"):
        p1.reveal({1, 2, 4}, {3})


def test_a_tensor_is_masked_once_per_round() -> None:
    setup = _setup(2, threshold=2)
    p = SecAggParticipant(1, setup)
    with pytest.raises(PrivacyError):
        p.mask_tensor("w", torch.zeros(3), 0.5, {1, 2})  # no shares exchanged yet
    q = SecAggParticipant(2, setup)
    directory = {1: p.advertise(), 2: q.advertise()}
    p.receive({})
    blob_for_p = q.share(directory)[1]
    p.share(directory)
    p.receive({2: blob_for_p})
    p.mask_tensor("w", torch.zeros(3), 0.5, {1, 2})
    with pytest.raises(PrivacyError, match="already masked"):
        p.mask_tensor("w", torch.zeros(3), 0.5, {1, 2})


def test_the_coordinator_refuses_malformed_steps() -> None:
    setup = _setup(3, threshold=2)
    coord = SecAggCoordinator(setup, {"w": (4,)})
    parts = {u: SecAggParticipant(u, setup) for u in (1, 2, 3)}
    for u, p in parts.items():
        coord.advertise(u, p.advertise())
    directory = coord.directory()
    with pytest.raises(PrivacyError, match="closed"):
        coord.advertise(9, SecAggParticipant(9, setup).advertise())
    sealed = parts[1].share(directory)
    with pytest.raises(PrivacyError, match="each of its"):
        coord.post_shares(1, {2: sealed[2]})
    coord.post_shares(1, sealed)
    with pytest.raises(PrivacyError, match="already"):
        coord.post_shares(1, sealed)
    with pytest.raises(PrivacyError, match="shared no keys"):
        coord.add_upload(2, [])


def test_an_upload_that_stops_half_way_makes_the_round_refused() -> None:
    setup = _setup(2, threshold=2)
    coord, parts = _round_to_masking(setup, [1, 2], {"a": (4,), "b": (4,)})
    masked = parts[1].mask({"a": torch.zeros(4), "b": torch.zeros(4)}, 0.5, coord.sharing())
    with pytest.raises(PrivacyError, match="misses"):
        coord.add_upload(1, [("a", masked["a"])])
    with pytest.raises(PrivacyError, match="unusable"):
        coord.add_upload(2, [])


def _round_to_masking(setup: RoundSetup, ids: list[int], shapes: dict[str, tuple[int, ...]],
                      ) -> tuple[SecAggCoordinator, dict[int, SecAggParticipant]]:
    """Every participant of `ids` advertised its keys, shared and read its mailbox: ready to mask."""
    coord = SecAggCoordinator(setup, shapes)
    parts = {u: SecAggParticipant(u, setup) for u in ids}
    for u, p in parts.items():
        coord.advertise(u, p.advertise())
    directory = coord.directory()
    for u, p in parts.items():
        coord.post_shares(u, p.share(directory))
    for u, p in parts.items():
        p.receive(coord.mailbox(u))
    return coord, parts


def _round_to_uploads(setup: RoundSetup, ids: list[int]) -> tuple[SecAggCoordinator, dict[int, SecAggParticipant]]:
    coord, parts = _round_to_masking(setup, ids, {"w": (4,)})
    for u, p in parts.items():
        coord.add_upload(u, p.mask({"w": torch.zeros(4)}, 1 / len(ids), coord.sharing()).items())
    return coord, parts


def test_a_revealed_share_of_the_wrong_kind_is_refused() -> None:
    """A survivor handing in a mask-key share of another survivor (which would let the coordinator
    strip that survivor's pairwise masks) is refused, not used."""
    setup = _setup(3, threshold=2)
    coord, parts = _round_to_uploads(setup, [1, 2, 3])
    survivors, dropped = coord.unmask_request()
    assert dropped == frozenset()
    coord.post_reveal(1, parts[1].reveal(survivors, dropped))
    honest = parts[2].reveal(survivors, dropped)
    forged = [RevealedShare(r.owner, "key", r.share) for r in honest]
    coord.post_reveal(2, forged)
    with pytest.raises(PrivacyError, match="should not"):
        dict(coord.finish({1: 1 / 3, 2: 1 / 3, 3: 1 / 3}))
    with pytest.raises(PrivacyError, match="already revealed"):
        coord.post_reveal(2, honest)


def test_a_sealed_bundle_of_the_wrong_size_is_refused_at_relay() -> None:
    setup = _setup(3, threshold=2)
    coord = SecAggCoordinator(setup, {"w": (4,)})
    parts = {u: SecAggParticipant(u, setup) for u in (1, 2, 3)}
    for u, p in parts.items():
        coord.advertise(u, p.advertise())
    sealed = parts[1].share(coord.directory())
    with pytest.raises(PrivacyError, match="bytes"):
        coord.post_shares(1, {v: blob + b"x" for v, blob in sealed.items()})
