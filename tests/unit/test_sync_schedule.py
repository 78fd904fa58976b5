"""The participant's schedule as a pure rule (`participant/engine/sync_schedule.py` `decide`): what
to do after an inner step, for blocking DiLoCo, the overlapped sync and Streaming DiLoCo, without
a coordinator or a clock; and the plan each config makes."""

from __future__ import annotations

import pytest

from fedtrain.config import RunConfig
from fedtrain.participant.engine.sync_schedule import Plan, decide

BLOCKING = Plan(4)
OVERLAPPED = Plan(4, overlap=True)
STREAMING = Plan(2, tau=1, alpha=0.5, streaming=True)  # H = 4, K = 2: S = 2 steps a round, sent after step 1


def after(plan: Plan, steps: int, *, in_flight: bool = False, ready: bool = False, may: bool = True) -> list[str]:
    return list(decide(plan, steps, in_flight=in_flight, ready=ready, may_attempt=may))


@pytest.mark.parametrize("steps,expected", [(1, []), (3, []), (4, ["exchange"]), (5, ["exchange"])])
def test_blocking_diloco_exchanges_from_the_h_th_step_on(steps: int, expected: list[str]) -> None:
    assert after(BLOCKING, steps) == expected


def test_an_outage_backoff_holds_every_attempt_back() -> None:
    assert after(BLOCKING, 4, may=False) == []
    assert after(STREAMING, 1, may=False) == [] and after(STREAMING, 2, may=False) == []
    assert after(OVERLAPPED, 4, may=False) == []


def test_the_overlapped_sync_sends_at_h_and_lands_when_the_answer_is_there() -> None:
    assert after(OVERLAPPED, 4) == ["send"]
    assert after(OVERLAPPED, 1, in_flight=True) == []  # training goes on while the exchange runs
    assert after(OVERLAPPED, 1, in_flight=True, ready=True) == ["land"]
    assert after(OVERLAPPED, 4, in_flight=True) == ["land", "send"]  # late: waited for at the next send
    assert after(OVERLAPPED, 4, in_flight=True, ready=True) == ["land", "send"]


def test_overlap_switched_off_lands_the_pending_round_before_a_blocking_exchange() -> None:
    assert after(BLOCKING, 4, in_flight=True) == ["land", "exchange"]
    assert after(BLOCKING, 2, in_flight=True, ready=True) == ["land"]
    assert after(BLOCKING, 2, in_flight=True) == []


def test_streaming_sends_tau_steps_early_and_lands_at_the_rounds_end() -> None:
    assert after(STREAMING, 0) == []
    assert after(STREAMING, 1) == ["send"]  # S − τ
    assert after(STREAMING, 1, in_flight=True, ready=True) == []  # never applied before S
    assert after(STREAMING, 2, in_flight=True) == ["land"]  # at S: waits for it
    assert after(STREAMING, 2) == ["exchange"]  # nothing in flight at S (a send that failed): all of it now


def test_streaming_overlapped_lands_at_the_first_step_the_answer_is_there() -> None:
    plan = Plan(2, tau=1, alpha=0.5, overlap=True, streaming=True)
    assert after(plan, 2, in_flight=True) == []
    assert after(plan, 3, in_flight=True, ready=True) == ["land"]


def test_streaming_with_tau_0_is_a_blocking_exchange_at_s() -> None:
    plan = Plan(2, streaming=True)
    assert after(plan, 1) == [] and after(plan, 2) == ["exchange"]


def test_the_plan_of_a_config() -> None:
    assert Plan.of(RunConfig(), 30, 1) == Plan(30)
    assert Plan.of(RunConfig.model_validate({"train": {"overlap": True}}), 30, 1) == Plan(30, overlap=True)
    streaming = RunConfig.model_validate({"train": {"sync_every": 8},
                                          "streaming": {"fragments": 2, "overlap": 1, "alpha": 0.3}})
    assert Plan.of(streaming, 8, 2) == Plan(4, tau=1, alpha=0.3, streaming=True)
