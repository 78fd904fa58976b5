"""The schedule: how many inner steps each participant is told for each round.

More: docs/architecture.md, "coordinator/rounds/schedule.py".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedtrain.config import RunConfig
from fedtrain.coordinator.policy.balance import Reported, measured_rate, plan_steps
from fedtrain.coordinator.state.events import Events
from fedtrain.coordinator.state.store import Store


def lockstep(cfg: RunConfig) -> str:
    return f"schedule.mode {cfg.schedule.mode}: every participant runs train.sync_every {cfg.train.sync_every}"


class Schedule:
    """The inner steps told to each participant, per round."""

    def __init__(self, store: Store, events: Events) -> None:
        self._store = store
        self._events = events

    def tell(self, pid: str, round_: int, current: int, cfg: RunConfig,
             reported: Mapping[str, Reported]) -> dict[str, Any]:
        """What `pid` runs in `round_` (`cfg`: the config in force then; `current`: the open round;
        `reported`: what each active participant last said of its speed): `{round, sync_every,
        mode, reason}`. In balanced rounds the open round's answer is recorded the first time
        it is asked, and from then on repeated; another round's is only looked up."""
        told = self._store.assignments(round_).get(pid)
        if told is not None:
            return self._view(round_, cfg, told["sync_every"], told["reason"])
        if cfg.schedule.mode != "balanced":
            return self._view(round_, cfg, cfg.train.sync_every, lockstep(cfg))
        if round_ != current:
            why = f"round {round_} is not the open round ({current}): train.sync_every {cfg.train.sync_every}"
            return self._view(round_, cfg, cfg.train.sync_every, why)
        per_step = cfg.train.batch_size * cfg.train.seq_len
        measured = {p: measured_rate(r, per_step) for p, r in reported.items()}
        measured.setdefault(pid, None)
        before = self._store.last_assignments(round_)
        plan = plan_steps(cfg.train.sync_every, measured, {p: a["steps_per_s"] for p, a in before.items()},
                          cfg.schedule)
        mine = plan[pid]
        self._store.add_assignment(round_, pid, mine.sync_every, mine.steps_per_s, mine.reason)
        previous = before.get(pid)
        if previous is not None and previous["sync_every"] != mine.sync_every:
            self._events.record("schedule", f"round {round_}: {mine.reason} (was H={previous['sync_every']})", pid)
        return self._view(round_, cfg, mine.sync_every, mine.reason)

    def status(self, round_: int, cfg: RunConfig, ids: list[str]) -> dict[str, dict[str, Any]]:
        """For the status: each participant's H for `round_` and why ({sync_every, reason}); None
        for a participant of a balanced round that has not been told yet."""
        told = self._store.assignments(round_)
        out: dict[str, dict[str, Any]] = {}
        for pid in ids:
            if pid in told:
                out[pid] = {"sync_every": told[pid]["sync_every"], "reason": told[pid]["reason"]}
            elif cfg.schedule.mode == "balanced":
                out[pid] = {"sync_every": None, "reason": f"{pid}: not told its inner steps for round {round_} yet"}
            else:
                out[pid] = {"sync_every": cfg.train.sync_every, "reason": lockstep(cfg)}
        return out

    @staticmethod
    def _view(round_: int, cfg: RunConfig, sync_every: int, reason: str) -> dict[str, Any]:
        return {"round": round_, "sync_every": int(sync_every), "mode": cfg.schedule.mode, "reason": reason}
