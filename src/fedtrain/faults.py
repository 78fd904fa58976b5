"""Fault injection at named points: how tests and chaos runs crash fedtrain on purpose.

Code that can fail in an interesting place calls `hit(point, who=..., round=...)`. With no
rule armed that is one dictionary lookup on an empty dict; with a matching rule it acts:

    kill     SIGKILL this process (a coordinator or participant dying mid-operation)
    raise    raise `InjectedFault` (an Exception: handled like any other failure)
    crash    raise `InjectedCrash` (a BaseException: unwinds like a dying process would,
             skipping `except Exception` handlers; a participant says no goodbye)
    sleep=S  block for S seconds (a slow upload, a stalled merge)
    drop     return "drop": the caller skips the operation (an upload lost on the way)

Rules are armed from tests (`with inject("merge.before_step", "raise"): ...`) or, for
processes a test starts, from the environment:

    FEDTRAIN_FAULTS="merge.before_step:kill:round=1,participant.upload:drop:who=p1:times=2"

one rule per comma; fields after the action are `who=` (participant name), `round=`,
`times=` (how often it fires, 0 = every time; default 1) and `after=` (matching hits to
let pass first). Points fedtrain calls (see POINTS): a rule for another name is refused,
so a typo cannot silently disarm a test.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from fedtrain.errors import ConfigError

log = logging.getLogger("fedtrain.faults")

ENV = "FEDTRAIN_FAULTS"

POINTS: dict[str, str] = {
    "join.answer": "coordinator: the roster took a join, its answer (config, model, assignment) not built yet",
    "upload.streaming": "coordinator: the first bytes of an upload are on disk, the rest still streaming",
    "upload.received": "coordinator: an upload is verified and spooled, not yet folded",
    "merge.before_step": "coordinator: a round is closing, before the outer optimizer step",
    "checkpoint.after_outer_write": "coordinator: the outer state file of the new version is written, the model not",
    "checkpoint.after_global_write": "coordinator: both checkpoint files are written, the database not yet",
    "commit.before_db": "coordinator: the round record is built, just before its database transaction",
    "commit.after_db": "coordinator: the round is committed in the database, memory not yet updated",
    "file.before_rename": "any atomic file write: the temp file is complete and synced, not yet renamed",
    "participant.sync": "participant: a sync starts (fail participant `who` at round `round`)",
    "participant.upload": "participant: just before an upload is sent (drop it, slow it, fail)",
    "participant.download": "participant: just before the global model is downloaded",
    "participant.checkpoint": "FSDP participant, rank 0: every rank's part of round `round`'s checkpoint is "
    "written, its state.json and rename not yet",
}

Action = Literal["kill", "raise", "crash", "sleep", "drop"]
_ACTIONS = ("kill", "raise", "crash", "sleep", "drop")


class InjectedFault(Exception):
    """Raised by a `raise` rule."""


class InjectedCrash(BaseException):
    """Raised by a `crash` rule; a BaseException so that it unwinds like a dying process."""


@dataclass
class Rule:
    point: str
    action: Action
    seconds: float = 0.0
    who: str | None = None
    round: int | None = None
    times: int = 1
    after: int = 0
    fired: int = 0
    seen: int = 0

    def matches(self, who: str | None, round_: int | None) -> bool:
        if self.who is not None and self.who != who:
            return False
        return self.round is None or self.round == round_

    @property
    def spent(self) -> bool:
        return self.times > 0 and self.fired >= self.times


_rules: dict[str, list[Rule]] = {}
_lock = threading.Lock()


def hit(point: str, *, who: str | None = None, round: int | None = None) -> str | None:
    """Called by fedtrain at `point`; returns "drop" when the caller should skip its operation."""
    if not _rules:  # the cost of a disarmed harness: one truth test
        return None
    rule = _take(point, who, round)
    if rule is None:
        return None
    where = f"{point} (who={who}, round={round})"
    log.warning("fault injected at %s: %s", where, rule.action)
    if rule.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is delivered asynchronously; never run on past the point
    if rule.action == "raise":
        raise InjectedFault(f"fault injected at {where}")
    if rule.action == "crash":
        raise InjectedCrash(f"crash injected at {where}")
    if rule.action == "sleep":
        time.sleep(rule.seconds)
        return None
    return "drop"


def _take(point: str, who: str | None, round_: int | None) -> Rule | None:
    with _lock:
        for rule in _rules.get(point, ()):
            if rule.spent or not rule.matches(who, round_):
                continue
            rule.seen += 1
            if rule.seen <= rule.after:
                continue
            rule.fired += 1
            return rule
    return None


def arm(rule: Rule) -> Rule:
    """Arm one rule (until `disarm`); returns it so a test can read `fired`."""
    if rule.point not in POINTS:
        raise ValueError(f"unknown fault point {rule.point!r}; known: {', '.join(POINTS)}")
    if rule.action not in _ACTIONS:
        raise ValueError(f"unknown fault action {rule.action!r}; known: {', '.join(_ACTIONS)}")
    with _lock:
        _rules.setdefault(rule.point, []).append(rule)
    return rule


def disarm(rule: Rule | None = None) -> None:
    """Remove one rule, or every rule."""
    with _lock:
        if rule is None:
            _rules.clear()
            return
        rules = _rules.get(rule.point, [])
        if rule in rules:
            rules.remove(rule)
        if not rules:
            _rules.pop(rule.point, None)


@contextlib.contextmanager
def inject(point: str, action: Action, **fields: object) -> Iterator[Rule]:
    """Arm a rule for the duration of a `with` block: `with inject("participant.upload", "drop"):`."""
    rule = arm(Rule(point, action, **fields))  # type: ignore[arg-type]
    try:
        yield rule
    finally:
        disarm(rule)


def parse(spec: str) -> list[Rule]:
    """Rules from the FEDTRAIN_FAULTS syntax (see the module docstring); ValueError names the problem."""
    rules = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        if len(fields) < 2:
            raise ValueError(f"fault rule {part!r} must be POINT:ACTION[:key=value...]")
        point, action = fields[0], fields[1]
        seconds = 0.0
        if action.startswith("sleep="):
            action, seconds = "sleep", float(action.split("=", 1)[1])
        rule = Rule(point, action, seconds)  # type: ignore[arg-type]
        for field in fields[2:]:
            key, _, value = field.partition("=")
            if key == "who":
                rule.who = value
            elif key in ("round", "times", "after"):
                setattr(rule, key, int(value))
            else:
                raise ValueError(f"fault rule {part!r}: unknown field {key!r} (who, round, times, after)")
        if rule.point not in POINTS or rule.action not in _ACTIONS:
            raise ValueError(f"fault rule {part!r}: unknown point or action")
        rules.append(rule)
    return rules


def arm_from_env(environ: dict[str, str] | None = None) -> list[Rule]:
    """Arm the rules of $FEDTRAIN_FAULTS (none when unset); called when a process starts."""
    spec = (environ if environ is not None else os.environ).get(ENV, "")
    try:
        parsed = parse(spec)
    except ValueError as e:
        raise ConfigError(f"${ENV}: {e}") from None
    rules = [arm(r) for r in parsed]
    if rules:
        log.warning("fault injection armed: %s", spec)
    return rules
