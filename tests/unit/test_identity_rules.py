"""The join rules of `auth.py` (issue #18 item 7), as pure functions: the clock is an argument."""

from __future__ import annotations

from fedtrain.coordinator import policy
from fedtrain.coordinator.members.auth import Holder, join_rule, key_hash, key_matches, new_participant_key, within_cap
from tests.helpers.config import tiny_config

CFG = tiny_config(heartbeat_timeout_s=20.0, max_participants_per_token=3, eviction_cooldown_s=600.0)
NOW = 10_000.0


def alive(pid: str, silent: float = 1.0, proven: bool = True) -> Holder:
    return Holder(pid, policy.ACTIVE, NOW - silent, proven=proven)


def rule(name: str, held: Holder | None, others: list[Holder], key_ok: bool = False, now: float = NOW):
    return join_rule(name, held, [*others, *([held] if held else [])], key_ok=key_ok, now=now, cfg=CFG)


def test_keys_are_random_and_only_their_hash_matches() -> None:
    a, b = new_participant_key(), new_participant_key()
    assert a != b and a.startswith("fk_") and len(a) > 40
    assert key_matches(a, key_hash(a)) and not key_matches(b, key_hash(a))
    assert not key_matches(None, key_hash(a)) and not key_matches(a, None)
    assert a not in key_hash(a)


def test_a_name_with_a_live_holder_is_refused_without_its_key_and_says_when_it_frees() -> None:
    held = alive("b", silent=5.0)
    claim = rule("b", held, [])
    assert (claim.action, claim.status, claim.code) == ("refuse", 409, "name_in_use")
    assert claim.retry_after_s == 15.0 and "15s" in claim.reason and "acts only as itself" in claim.reason
    assert rule("b", held, [], key_ok=True).action == "rejoin"


def test_a_name_is_taken_over_without_its_key_only_when_its_holder_cannot_be_acting() -> None:
    cases = {
        "failed": Holder("b", policy.FAILED, NOW - 1),
        "left": Holder("b", policy.LEFT, NOW - 1),
        "silent past the timeout": alive("b", silent=21.0),
        "not heard from since the coordinator started": alive("b", proven=False),
        "joined before keys": Holder("b", policy.ACTIVE, NOW - 1, keyed=False, proven=True),
    }
    for why, held in cases.items():
        claim = rule("b", held, [])
        assert claim.action == "take_over", (why, claim)
        assert claim.reason
    evicted = Holder("b", policy.EVICTED, NOW - 1, evicted_at=NOW - 1)
    assert rule("b", evicted, [], key_ok=True).code == "evicted"
    assert rule("c", None, []).action == "new"


def test_a_token_holds_at_most_its_cap_of_active_participants() -> None:
    three = [alive(f"p{i}") for i in range(3)]
    claim = rule("p3", None, three)
    assert (claim.action, claim.status, claim.code) == ("refuse", 403, "too_many_participants")
    assert "max_participants_per_token (3)" in claim.reason
    assert rule("p0", three[0], three[1:], key_ok=True).action == "rejoin"  # an active one rejoining is not a new one
    failed = Holder("p3", policy.FAILED, NOW - 100)
    assert rule("p3", failed, three, key_ok=True).code == "too_many_participants"  # back to active: counted
    assert within_cap(three, "p3", CFG) is not None and within_cap(three[:2], "p3", CFG) is None
    gone = [Holder(f"q{i}", s, NOW - 1) for i, s in enumerate((policy.FAILED, policy.LEFT, policy.EVICTED))]
    assert rule("p3", None, [*three[:2], *gone]).action == "new"  # only active ones count


def test_after_an_eviction_the_token_takes_no_new_key_for_the_cool_down() -> None:
    evicted = Holder("bad", policy.EVICTED, NOW - 50, evicted_at=NOW - 10)
    friend = alive("friend")
    claim = rule("bad-2", None, [evicted, friend])
    assert (claim.action, claim.status, claim.code) == ("refuse", 403, "evicted_recently")
    assert "'bad'" in claim.reason and claim.retry_after_s == 590.0
    assert rule("friend", friend, [evicted], key_ok=True).action == "rejoin"  # a participant with its key goes on
    assert rule("ghost", Holder("ghost", policy.FAILED, NOW - 100), [evicted]).code == "evicted_recently"
    assert rule("bad-2", None, [evicted, friend], now=NOW + 600).action == "new"  # the cool-down is over
    no_cooldown = tiny_config(eviction_cooldown_s=0.0)
    assert join_rule("bad-2", None, [evicted], key_ok=False, now=NOW, cfg=no_cooldown).action == "new"
