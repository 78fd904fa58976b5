"""A participant's pace: how fast its own loop runs inner steps, a throttle that makes it slow on
purpose, and the inner steps the coordinator told it for a round.

`Pace` times the user's loop between two `Participant.step` calls (the forward, backward and
optimizer step, data loading included; the syncs, which run inside `step`, left out), so its
rate (`steps_per_s`, sent with the heartbeats) is the participant's compute speed whatever
its H, and balanced rounds (`coordinator/balance.py`) can set its H from it. With `speed`
below 1 it also sleeps at each step for (1/speed - 1) x the step's own time: the participant
runs at `speed` times its natural pace (a slow site for tests and `fedtrain demo
--heterogeneous`). Runs on the training thread; the heartbeat thread reads only
`steps_per_s`, one float.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Pace", "check_speed", "told_steps"]

WINDOW = 50
"""Steps the rate is taken over: enough that one slow step does not swing it."""


def check_speed(speed: float) -> float:
    """`speed` if it is a throttle that can work (0 < speed <= 1), else ValueError saying why."""
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not (0 < speed <= 1) or math.isnan(speed):
        raise ValueError(f"speed must be a number above 0 and at most 1 (1: full speed, 0.5: half), not {speed!r}")
    return float(speed)


class Pace:
    """The participant's inner-step rate, and its throttle (`speed`, 1: none)."""

    def __init__(self, speed: float = 1.0, *, window: int = WINDOW,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> None:
        self.speed = check_speed(speed)
        self._clock = clock
        self._sleep = sleep
        self._since: float | None = None  # when the loop got control back from the last `step`
        self._times: deque[float] = deque(maxlen=window)
        self._rate: float | None = None
        self.slept_s = 0.0  # time spent throttled, in all

    @property
    def steps_per_s(self) -> float | None:
        """Inner steps per second of the loop over the last `window` steps (None: fewer than one)."""
        return self._rate

    def resume(self) -> None:
        """The loop has control again (a `step` returned, or the participant joined)."""
        self._since = self._clock()

    def stepped(self) -> None:
        """The loop finished one inner step (`step` was called): throttle it, then time it."""
        if self._since is None:
            return
        own = max(0.0, self._clock() - self._since)
        if self.speed < 1:
            pause = own * (1 / self.speed - 1)
            self._sleep(pause)
            self.slept_s += pause
        self._times.append(max(0.0, self._clock() - self._since))
        self._since = None
        total = sum(self._times)
        self._rate = len(self._times) / total if total > 0 else None


def told_steps(answer: Any) -> tuple[int, str] | None:
    """The inner steps (and why) in a coordinator's join or config answer (`assignment`), or
    None when it names none that can work (an older coordinator, a malformed answer)."""
    told = answer.get("assignment") if isinstance(answer, dict) else None
    steps = told.get("sync_every") if isinstance(told, dict) else None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        return None
    reason = told.get("reason") if isinstance(told, dict) else None
    return steps, reason if isinstance(reason, str) else ""
