"""The fault-injection harness: rule syntax, matching, counting, and the disarmed fast path."""

from __future__ import annotations

import time

import pytest

from fedtrain import faults
from fedtrain.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean() -> None:
    faults.disarm()
    yield
    faults.disarm()


def test_disarmed_hit_does_nothing() -> None:
    assert faults.hit("merge.before_step", round=3) is None


def test_parse_full_syntax() -> None:
    rules = faults.parse(
        "merge.before_step:kill:round=1, participant.upload:drop:who=p1:times=2:after=1,upload.received:sleep=0.5"
    )
    assert [(r.point, r.action) for r in rules] == [
        ("merge.before_step", "kill"),
        ("participant.upload", "drop"),
        ("upload.received", "sleep"),
    ]
    assert rules[0].round == 1 and rules[0].times == 1
    assert (rules[1].who, rules[1].times, rules[1].after) == ("p1", 2, 1)
    assert rules[2].seconds == 0.5


@pytest.mark.parametrize(
    "spec",
    [
        "merge.before_step",
        "nowhere:kill",
        "merge.before_step:explode",
        "merge.before_step:kill:colour=red",
        "merge.before_step:kill:round=x",
    ],
)
def test_bad_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        faults.parse(spec)
    with pytest.raises(ConfigError, match="FEDTRAIN_FAULTS"):
        faults.arm_from_env({faults.ENV: spec})


def test_rule_matches_who_and_round_and_counts() -> None:
    rule = faults.arm(faults.Rule("participant.upload", "drop", who="p1", round=2, times=2, after=1))
    assert faults.hit("participant.upload", who="p0", round=2) is None  # someone else
    assert faults.hit("participant.upload", who="p1", round=1) is None  # another round
    assert faults.hit("participant.upload", who="p1", round=2) is None  # let through: after=1
    assert faults.hit("participant.upload", who="p1", round=2) == "drop"
    assert faults.hit("participant.upload", who="p1", round=2) == "drop"
    assert faults.hit("participant.upload", who="p1", round=2) is None  # times=2 spent
    assert rule.fired == 2


def test_raise_crash_and_sleep() -> None:
    with faults.inject("merge.before_step", "raise"), pytest.raises(faults.InjectedFault):
        faults.hit("merge.before_step")
    assert faults.hit("merge.before_step") is None  # the with block disarmed it
    with faults.inject("participant.sync", "crash"), pytest.raises(faults.InjectedCrash):
        faults.hit("participant.sync")
    assert not issubclass(faults.InjectedCrash, Exception)  # `except Exception` does not swallow it
    with faults.inject("upload.received", "sleep", seconds=0.2):
        t0 = time.monotonic()
        faults.hit("upload.received")
        assert time.monotonic() - t0 >= 0.2


def test_times_zero_fires_every_time_and_env_arms() -> None:
    rules = faults.arm_from_env({faults.ENV: "commit.before_db:raise:times=0"})
    for _ in range(3):
        with pytest.raises(faults.InjectedFault):
            faults.hit("commit.before_db", round=7)
    assert rules[0].fired == 3
    assert faults.arm_from_env({}) == []


def test_every_point_is_called_somewhere_in_the_source() -> None:
    from pathlib import Path

    src = "\n".join(p.read_text() for p in (Path(faults.__file__).parent).rglob("*.py") if p.name != "faults.py")
    missing = [point for point in faults.POINTS if f'"{point}"' not in src]
    assert not missing, f"fault points no code calls: {missing}"
