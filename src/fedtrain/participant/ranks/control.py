"""The ranks of one participant, and the control messages they exchange: every rank enters each
collective, in the same order.

`RankGroup` gives the participant engine the few collectives its decisions need, on a **gloo
process group of its own**, created beside the training group: control messages are small CPU
tensors (JSON as bytes after its length, never pickled), and they work whether training runs on
gloo or NCCL (NCCL has no CPU tensors). Only `broadcast_tensors` (a replicated group's new
weights) uses the training group, with the tensors on their own device. Outside torchrun (or with
one rank) every collective is the identity and `together` runs its work on the calling thread.

`together(work)` is the one that waits on the network: each rank runs its own `work` on a worker
thread while the main thread all-reduces (running?) every `keepalive_s`, so no rank sits in one
collective long enough to hit a timeout, and the ranks exchange their outcomes (`Outcome`) so
that every rank takes the same decision from the same facts. A rank whose peer closed the
control channel waits a moment for its own stop signal (the group is being stopped) and else
fails with `DistributedSyncError`, one line. See docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fedtrain.errors import CoordinatorError, FedtrainError
from fedtrain.participant.engine.outage import is_transient

__all__ = ["DistributedSyncError", "Outcome", "RankGroup", "control_group"]

PEER_GONE_GRACE_S = 2.0
"""How long a rank whose peer closed the control channel waits for a stop signal of its own
before it fails: torchrun (or Ctrl+C) stops every rank at once, and a rank that stopped a moment
earlier closes the channel under the others."""


@contextlib.contextmanager
def _peers(rank: int) -> Iterator[None]:
    """A collective on the control channel: if another rank closed it (gloo raises RuntimeError),
    wait PEER_GONE_GRACE_S for this rank's own stop (a signal there ends it as `stopped`), then
    fail with one line, not torch's traceback."""
    try:
        yield
    except RuntimeError as e:
        time.sleep(PEER_GONE_GRACE_S)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedSyncError(f"rank {rank}: another rank of this participant's group went away "
                                   f"(its control channel closed: {first})") from None


def control_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """A gloo process group over the ranks of `group` (None: every rank) for control messages.
    Making one is collective: every rank of the job must make it at the same point."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return dist.new_group(ranks=ranks, backend="gloo")


class DistributedSyncError(FedtrainError):
    """A rank of the participant failed; every rank stops with its message."""


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

    @classmethod
    def of(cls, rank: int, result: Any = None, error: BaseException | None = None) -> Outcome:
        if error is None:
            return cls(rank, True, result)
        code = error.code if isinstance(error, CoordinatorError) else type(error).__name__
        message = getattr(error, "message", None) or str(error) or type(error).__name__
        return cls(rank, False, error=message, code=code, transient=is_transient(error))


class RankGroup:
    """The ranks of one participant: the default process group, `group`, or (outside torchrun)
    this process alone."""

    def __init__(self, group: dist.ProcessGroup | None = None, keepalive_s: float = 5.0) -> None:
        self.group = group  # the training group (new weights of a replicated group travel on it)
        self.keepalive_s = keepalive_s
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.control: Any = control_group(group) if self.world_size > 1 else None
        # a second channel for the collectives of the overlapped sync's worker thread (`for_worker`)
        self._worker_control: Any = control_group(group) if self.world_size > 1 else None

    def close(self) -> None:
        """Destroy the control group while the interpreter is whole: a gloo group left to the
        interpreter's teardown can abort the process ("terminate called without an active
        exception"). Idempotent; the training group is the caller's."""
        control, self.control = self.control, None
        worker, self._worker_control = getattr(self, "_worker_control", None), None
        for g in (control, worker):
            if g is not None and dist.is_initialized():
                dist.destroy_process_group(g)

    def for_worker(self) -> RankGroup:
        """These ranks over a second gloo channel, for the collectives of the overlapped sync's
        worker thread (an FSDP group's masked pieces, `secagg_pieces.exchange_masked_piece`) while
        the main thread trains and uses `control`: one exchange in flight per rank, so every rank
        enters them in one order. Closed with this group."""
        view = copy.copy(self)
        view.control, view._worker_control = self._worker_control, None
        return view

    @property
    def solo(self) -> bool:
        """One rank: every collective is the identity."""
        return self.world_size == 1

    @property
    def lead(self) -> bool:
        """Rank 0, which speaks for the group (join, reports, heartbeats)."""
        return self.rank == 0

    def together(self, work: Callable[[], Any] | None,
                 cancel: threading.Event | None = None) -> tuple[list[Outcome], BaseException | None]:
        """Run `work` (whose result must be JSON) while every rank keeps the group alive; returns
        every rank's outcome, and this rank's own error (to re-raise) if any. Once any rank's work
        has failed, `cancel` is set on every rank, so that a rank waiting for something the failed
        one was to do (the rest of the update) stops waiting."""
        if self.solo:
            try:
                return [Outcome.of(0, work() if work is not None else None)], None
            except Exception as e:  # noqa: BLE001 - the caller decides from the outcome
                return [Outcome.of(0, error=e)], e
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
            with _peers(self.rank):
                dist.all_reduce(state, group=self.control)
            if int(state[0]) == 0:
                break
            if int(state[1]) > 0 and cancel is not None:
                cancel.set()
        error = box.get("error")
        mine = Outcome.of(self.rank, box.get("result"), error)
        outcomes = [Outcome(**o) for o in self.gather_json(mine.as_json())]
        return outcomes, error

    def broadcast_json(self, payload: Any) -> Any:
        """`payload` (JSON) from rank 0 to every rank; other ranks pass anything (ignored)."""
        if self.solo:
            return payload
        data = json.dumps(payload).encode() if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        src = dist.get_global_rank(self.control, 0)  # the group's rank 0
        with _peers(self.rank):
            dist.broadcast(size, src=src, group=self.control)
            body = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 and data else \
                torch.empty(int(size), dtype=torch.uint8)
            dist.broadcast(body, src=src, group=self.control)
        return json.loads(body.numpy().tobytes().decode())

    def gather_json(self, payload: Any) -> list[Any]:
        """Every rank's `payload` (JSON), in rank order, on every rank."""
        if self.solo:
            return [json.loads(json.dumps(payload))]
        data = json.dumps(payload).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        with _peers(self.rank):
            dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.control)
            longest = max(int(s) for s in sizes)
            mine = torch.zeros(longest, dtype=torch.uint8)
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # JSON is never empty
            got = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(got, mine, group=self.control)
        return [json.loads(t[:int(n)].numpy().tobytes().decode()) for t, n in zip(got, sizes, strict=True)]

    def sum(self, values: Sequence[float]) -> list[float]:
        """The sum over the ranks of each of `values` (float64)."""
        if self.solo:
            return [float(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.float64)
        with _peers(self.rank):
            dist.all_reduce(t, group=self.control)
        return [float(v) for v in t]

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank."""
        if self.solo:
            return flag
        t = torch.tensor([int(not flag)], dtype=torch.int64)
        with _peers(self.rank):
            dist.all_reduce(t, group=self.control)
        return int(t) == 0

    def rank0_says(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank."""
        if self.solo:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64)
        with _peers(self.rank):
            dist.broadcast(t, src=dist.get_global_rank(self.control, 0), group=self.control)
        return bool(int(t))

    def broadcast_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Each of `tensors` from rank 0 to every rank, in place, on the training group (the
        tensors stay on their device: NCCL takes CUDA tensors)."""
        if self.solo:
            return
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t, src=src, group=self.group)

    # -- deciding from the outcomes (the same on every rank) -----------------------------------------

    def raise_failed(self, outcomes: list[Outcome], error: BaseException | None) -> None:
        """Raise on every rank if any rank's work failed: its own error where it failed."""
        if error is not None:
            raise error
        failed = [o for o in outcomes if not o.ok]
        if failed:
            if self.solo:
                raise DistributedSyncError(failed[0].error)
            raise DistributedSyncError("; ".join(f"rank {o.rank} of this participant failed: {o.error}"
                                                 for o in failed))

    def raise_lasting(self, outcomes: list[Outcome], error: BaseException | None) -> None:
        """Raise on every rank if a rank failed with an error that is not one to ride out."""
        if not all(o.ok or o.transient for o in outcomes):
            self.raise_failed(outcomes, error)

    @staticmethod
    def agreed(outcomes: list[Outcome]) -> int:
        """The global version every rank that downloaded got (a rank holding no rows gets -1)."""
        versions = {int(o.result) for o in outcomes if o.result is not None and int(o.result) >= 0}
        if len(versions) != 1:
            raise DistributedSyncError(f"the ranks of this participant downloaded different global versions "
                                       f"({sorted(versions)})")
        return versions.pop()
