"""The collectives of a participant made of many ranks: every rank enters each one, in the same order.

`RankGroup` wraps a torch.distributed process group with the few collectives a sharded
participant needs (`fsdp.py`), none of which pickles anything: JSON travels as a byte
tensor, after its length.

`together(work)` is the one that waits on the network. Each rank runs its own `work` (its
HTTP calls, or nothing) on a worker thread while the main thread all-reduces (running,
per rank) every `keepalive_s`: no rank sits in one collective long enough to hit the
process group's timeout, and every rank leaves the loop at the same all-reduce. Then the
ranks exchange their outcomes (`Outcome`: the work's JSON result, or its error and whether
the error is one to ride out), so that every rank takes the same decision from the same
facts.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fedtrain.errors import CoordinatorError
from fedtrain.participant.outage import is_transient

__all__ = ["Outcome", "RankGroup"]


@dataclass(frozen=True)
class Outcome:
    """What one rank's `work` came to: its result, or its error."""

    rank: int
    ok: bool
    result: Any = None
    error: str = ""
    code: str = ""
    transient: bool = False  # an error a participant rides out (`outage.is_transient`)

    def as_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "ok": self.ok, "result": self.result, "error": self.error, "code": self.code,
                "transient": self.transient}


class RankGroup:
    """The ranks of one participant (the default process group, or `group`)."""

    def __init__(self, group: dist.ProcessGroup | None = None, keepalive_s: float = 5.0) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.keepalive_s = keepalive_s

    def together(self, work: Callable[[], Any] | None,
                 cancel: threading.Event | None = None) -> tuple[list[Outcome], BaseException | None]:
        """Run `work` (whose result must be JSON) on a thread while every rank keeps the group
        alive; returns every rank's outcome, and this rank's own error (to re-raise) if any.
        Once any rank's work has failed, `cancel` is set on every rank, so that a rank waiting
        for something the failed one was to do (the rest of the update) stops waiting."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = work() if work is not None else None
            except BaseException as e:  # noqa: BLE001 - every rank learns of it below
                box["error"] = e

        worker = threading.Thread(target=run, name=f"fedtrain-rank{self.rank}-sync", daemon=True)
        worker.start()
        if cancel is not None:
            cancel.clear()
        while True:
            worker.join(self.keepalive_s)
            state = torch.tensor([int(worker.is_alive()), int(not worker.is_alive() and "error" in box)],
                                 dtype=torch.int64)
            dist.all_reduce(state, group=self.group)
            if int(state[0]) == 0:
                break
            if int(state[1]) > 0 and cancel is not None:
                cancel.set()
        error = box.get("error")
        if error is None:
            mine = Outcome(self.rank, True, box.get("result"))
        else:
            code = error.code if isinstance(error, CoordinatorError) else type(error).__name__
            message = getattr(error, "message", None) or str(error) or type(error).__name__
            mine = Outcome(self.rank, False, error=message, code=code, transient=is_transient(error))
        outcomes = [Outcome(**o) for o in self.gather_json(mine.as_json())]
        return outcomes, error

    def broadcast_json(self, payload: Any) -> Any:
        """`payload` (JSON) from rank 0 to every rank; other ranks pass anything (ignored)."""
        data = json.dumps(payload).encode() if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)  # the group's rank 0
        dist.broadcast(size, src=src, group=self.group)
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 and data else \
            torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(body, src=src, group=self.group)
        return json.loads(body.numpy().tobytes().decode())

    def gather_json(self, payload: Any) -> list[Any]:
        """Every rank's `payload` (JSON), in rank order, on every rank."""
        data = json.dumps(payload).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # JSON is never empty
        got = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(got, mine, group=self.group)
        return [json.loads(t[:int(n)].numpy().tobytes().decode()) for t, n in zip(got, sizes, strict=True)]

    def sum(self, values: Sequence[float]) -> list[float]:
        """The sum over the ranks of each of `values` (float64)."""
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return [float(v) for v in t]

    def rank0_says(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank."""
        t = torch.tensor([int(flag)], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.group)
        return bool(int(t))
