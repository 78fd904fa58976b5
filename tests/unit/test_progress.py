"""transport/progress.py: the rate over a window, the ETA, the log line, on an injected clock."""

import logging

from fedtrain.transport.progress import RATE_WINDOW_S, Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_eta_and_view_follow_the_bytes() -> None:
    clock = Clock()
    p = Progress("upload of round 5", 100_000_000, clock=clock)
    assert p.rate() == 0 and p.eta_s() is None
    for _ in range(4):
        clock.now += 1
        p.add(10_000_000)
    assert p.rate() == 10_000_000
    assert p.eta_s() == 6.0
    view = p.view()
    assert view == {"what": "upload of round 5", "bytes": 40_000_000, "total": 100_000_000,
                    "rate_bps": 10_000_000.0, "eta_s": 6.0, "elapsed_s": 4.0}
    assert p.line() == "upload of round 5: 40.0 of 100.0 MB (40%), 10.0 MB/s, 6 s left"


def test_a_stall_shows_in_the_rate_within_the_window() -> None:
    clock = Clock()
    p = Progress("download of version 3", None, clock=clock)
    for _ in range(10):
        clock.now += 1
        p.add(1_000_000)
    clock.now += RATE_WINDOW_S + 2  # silent since
    p.add(0)
    assert p.rate() < 200_000
    assert p.eta_s() is None  # no total
    assert p.line().startswith("download of version 3: 10.0 MB, ")


def test_logs_a_line_every_few_seconds(caplog) -> None:
    clock = Clock()
    log = logging.getLogger("fedtrain.test.progress")
    p = Progress("upload", 10, log=log, every_s=5, clock=clock)
    with caplog.at_level(logging.INFO, logger="fedtrain.test.progress"):
        for _ in range(12):
            clock.now += 1
            p.add(0)
    assert len(caplog.records) == 2
