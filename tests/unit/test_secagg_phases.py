"""The pure decisions of secure aggregation in a run: when a phase closes (the clock an argument, the
reason said), the round's threshold from the participants that advertised, and the setup a
participant rebuilds from the coordinator's JSON."""

from __future__ import annotations

import pytest

from fedtrain.config import RunConfig
from fedtrain.coordinator.secagg.phases import decide_phase, holders, setup_for, threshold
from fedtrain.privacy.round_setup import setup_from_json, setup_json


def privacy(**fields: object) -> object:
    cfg = RunConfig.model_validate({"privacy": {"secure_aggregation": True, "dp": False, **fields}})
    return cfg.privacy


def test_a_phase_closes_when_everyone_answered_and_not_before_t() -> None:
    d = decide_phase("shares", {"a", "b", "c"}, {"a", "b", "c"}, 2, now=1.0, since=0.0, timeout_s=30)
    assert d.action == "advance" and "everyone" in d.reason
    d = decide_phase("shares", {"a", "b", "c"}, {"a", "b"}, 2, now=1.0, since=0.0, timeout_s=30)
    assert d.action == "wait" and "c" in d.reason
    d = decide_phase("keys", {"a"}, {"a"}, 2, now=100.0, since=0.0, timeout_s=30)
    assert d.action == "wait"  # everyone, but fewer than the 2 a round needs


def test_at_the_timeout_a_phase_goes_on_with_t_answers_or_starts_again() -> None:
    d = decide_phase("shares", {"a", "b", "c"}, {"a", "b"}, 2, now=30.0, since=0.0, timeout_s=30)
    assert d.action == "advance" and "did not answer" in d.reason
    d = decide_phase("shares", {"a", "b", "c"}, {"a"}, 2, now=30.0, since=0.0, timeout_s=30)
    assert d.action == "restart" and "fresh keys" in d.reason
    d = decide_phase("keys", {"a", "b", "c"}, {"a"}, 2, now=30.0, since=0.0, timeout_s=30)
    assert d.action == "wait"  # the keys phase never restarts: it waits for more participants
    d = decide_phase("reveal", {"a", "b"}, set(), 2, now=30.0, since=0.0, timeout_s=30)
    assert d.action == "advance"  # the unmasking says whether the shares suffice
    assert decide_phase("keys", {"a", "b"}, {"a"}, 2, now=1e9, since=None, timeout_s=30).action == "wait"
    assert decide_phase("upload", set(), set(), 2, now=0, since=0, timeout_s=1).action == "wait"


def test_the_claims_phase_waits_for_training_then_gives_the_rest_the_phase_time() -> None:
    """Claims come after the inner steps: no clock until the first claim (since None), then the
    phase's time; with fewer than t claims it waits (the round's deadline ends it), never restarts."""
    assert decide_phase("claims", {"a", "b"}, set(), 2, now=1e9, since=None, timeout_s=30).action == "wait"
    assert decide_phase("claims", {"a", "b"}, {"a", "b"}, 2, now=1.0, since=0.0, timeout_s=30).action == "advance"
    d = decide_phase("claims", {"a", "b", "c"}, {"a", "b"}, 2, now=29.0, since=0.0, timeout_s=30)
    assert d.action == "wait" and "c" in d.reason
    d = decide_phase("claims", {"a", "b", "c"}, {"a", "b"}, 2, now=30.0, since=0.0, timeout_s=30)
    assert d.action == "advance" and "did not answer" in d.reason
    assert decide_phase("claims", {"a", "b", "c"}, {"a"}, 2, now=300.0, since=0.0, timeout_s=30).action == "wait"


@pytest.mark.parametrize("n, degree, t", [(2, None, 2), (3, None, 2), (4, None, 3), (9, None, 6), (20, 4, 4),
                                          (20, 5, 5), (4, 8, 3)])
def test_the_default_threshold_is_two_thirds_of_each_secrets_holders(n: int, degree: int | None, t: int) -> None:
    assert threshold(n, privacy(secagg_degree=degree, secagg_max_participants=64)) == t
    assert t > holders(n, degree) / 2  # more than half of the holders, as Bonawitz et al. ask


def test_a_setup_travels_as_json_and_each_attempt_has_its_own_tag() -> None:
    p = privacy(secagg_max_participants=8, secagg_range=0.25, secagg_threshold=3)
    one = setup_for("run", "0123456789abcdef", 7, 5, p, b"\1" * 16)
    other = setup_for("run", "fedcba9876543210", 7, 5, p, b"\1" * 16)
    assert setup_from_json(setup_json(one)) == one
    assert one.tag != other.tag and one.threshold == 3 and one.degree is None
    assert one.fixed_point.bits == 16 and one.fixed_point.precision_bits == 12  # 16 - 1 - log2(8)
