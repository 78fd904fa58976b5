"""A participant's processes as the coordinator reads them (`coordinator/ranks.py`), and the
share of the sync set an update's pieces hold (`pieces.Coverage.fraction`): pure functions."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fedtrain.coordinator.intake.pieces import Coverage, Partial, PiecesIn
from fedtrain.coordinator.members.processes import MAX_WORLD_SIZE, check_info, describe
from fedtrain.errors import Refused
from fedtrain.participant.ranks import control


@pytest.mark.parametrize(("info", "seen"), [
    ({}, ("single", 1)),
    ({"world_size": 1}, ("single", 1)),
    ({"parallel": None, "world_size": None}, ("single", 1)),
    ({"parallel": "single"}, ("single", 1)),
    ({"parallel": "ddp", "world_size": 4}, ("ddp", 4)),
    ({"parallel": "fsdp", "world_size": MAX_WORLD_SIZE}, ("fsdp", MAX_WORLD_SIZE)),
    ({"parallel": "fsdp"}, ("fsdp", None)),
    ({"world_size": 8}, (None, 8)),  # several ranks, not a word on how they train
    ({"parallel": "single", "world_size": 3}, (None, 3)),
    ({"parallel": "FSDP", "world_size": 2}, (None, 2)),
    ({"parallel": {"kind": "fsdp"}}, (None, None)),
    ({"parallel": "ddp", "world_size": MAX_WORLD_SIZE + 1}, ("ddp", None)),
    ({"parallel": "ddp", "world_size": True}, ("ddp", None)),
    ({"parallel": "ddp", "world_size": 2.0}, ("ddp", None)),
    ([1, 2], (None, None)),
    ("fsdp", (None, None)),
])
def test_describe_reads_any_stored_info_and_never_raises(info: Any, seen: tuple[str | None, int | None]) -> None:
    assert describe(info) == seen


def test_check_info_takes_what_describe_reads_back_as_said() -> None:
    for info in ({}, {"host": "x"}, {"world_size": 1}, {"parallel": "ddp", "world_size": 2}, {"parallel": "fsdp"},
                 {"parallel": "single", "world_size": 1}, {"parallel": None, "world_size": None}):
        check_info(info)
        assert describe(info)[0] is not None, info
    for info in ({"parallel": "mpi"}, {"world_size": 0}, {"world_size": "2"}, {"parallel": "single", "world_size": 2}):
        with pytest.raises(Refused) as refused:
            check_info(info)
        assert refused.value.status == 400 and refused.value.code == "invalid_info"


def test_coverage_fraction_counts_elements_not_tensors() -> None:
    model = {"big": (torch.float32, (4, 10)), "small": (torch.float32, (2,)), "scalar": (torch.float32, ())}
    cov = Coverage(model)
    assert cov.fraction() == 0.0
    cov.add("rank0", {"big": (0, 2)})
    assert cov.fraction() == pytest.approx(20 / 43)
    cov.add("rank1", {"big": (2, 4), "small": (0, 2)})
    assert cov.fraction() == pytest.approx(42 / 43) and not cov.complete
    partial = Partial(10, cov)
    view = PiecesIn.of(partial).view()
    assert view == {"received": 0, "labels": [], "covered": 0.9767, "complete": False}
    cov.add("rank2", {"scalar": (0, 1)})
    assert cov.fraction() == 1.0 and cov.complete
    assert Coverage({"empty": (torch.float32, (0, 3))}).fraction() == 1.0  # nothing to hold


def test_the_status_lists_a_bounded_number_of_labels() -> None:
    cov = Coverage({"w": (torch.float32, (300,))})
    partial = Partial(1, cov)
    for i in range(300):
        cov.add(f"r{i:03d}", {"w": (i, i + 1)})
        partial.pieces[f"r{i:03d}"] = None  # type: ignore[assignment]  # the view reads the labels only
    view = PiecesIn.of(partial).view()
    assert view["received"] == 300 and len(view["labels"]) == 16 and view["labels"][0] == "r000"
    assert view["complete"] is True and view["covered"] == 1.0


def _rank1_of_two() -> control.RankGroup:
    group = object.__new__(control.RankGroup)
    group.group, group.keepalive_s, group.rank, group.world_size = None, 1.0, 1, 2
    group.control, group._worker_control = object(), None
    return group


def _peer_closed(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:41195. ...")


def test_a_rank_whose_peer_closed_the_control_channel_fails_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "PEER_GONE_GRACE_S", 0.0)
    monkeypatch.setattr(control.dist, "all_reduce", _peer_closed)
    with pytest.raises(control.DistributedSyncError, match="rank 1: another rank .* went away .*Connection closed"):
        _rank1_of_two().sum([1.0])


def test_a_rank_whose_peer_closed_the_channel_stops_as_stopped_when_its_own_signal_follows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun stops every rank at once: the rank that stopped first closes the channel under the
    others, whose own signal comes a moment later and must end them as `stopped`, not failed."""
    import os
    import signal
    import threading

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(control, "PEER_GONE_GRACE_S", 30.0)
    monkeypatch.setattr(control.dist, "all_reduce", _peer_closed)
    old = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            _rank1_of_two().all_true(True)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)
