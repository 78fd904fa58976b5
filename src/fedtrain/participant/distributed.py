"""torchrun participants: one federated participant made of several processes (DDP inside a site).

Only rank 0 talks to the coordinator: it holds an ordinary `Participant`. The other ranks
hold no client at all; they learn everything from rank 0 through `torch.distributed`.
`DistributedParticipant` has the same loop-facing surface on every rank (`step`,
`finished`, `round`, `config`, `sync_every`), so one training script runs on all ranks.

Every collective happens on every rank in the same order, and every decision (synced?
finished? new H? failed?) is taken on rank 0 and broadcast, so no rank can wait on a
collective that another rank will never enter:

    enter:        rank 0 joins (worker thread) ── CONTROL(WAIT)* ── CONTROL(READY | ERROR) ── θ
    step < H:     nothing of ours (DDP all-reduces gradients as usual)
    step >= H:    ALL_REDUCE(tokens, loss sum, loss count not yet handed over)
                  rank 0 steps its Participant (worker thread) ── CONTROL(WAIT)* ── CONTROL(DONE | ERROR) ── [θ]

Every rank counts the steps of a round itself; below H the inner `Participant` cannot
sync, so those steps cost no collective. From the H-th step on each step is a sync
point: rank 0's `Participant.step` either syncs (DONE says so and θ follows) or, while
the coordinator is unreachable, keeps training and retries at a later step (DONE without
θ: the next step is a sync point again). H, which a live config change may alter at a
round boundary, travels in each message with the round, `finished` and the config.
While rank 0 waits on a slow coordinator it broadcasts a WAIT every `keepalive_s`, so
the other ranks never sit in one collective long enough to hit the process group's
timeout. A failure on rank 0 (coordinator gone for longer than its budget, model
refused) is broadcast as ERROR with its message, and every rank raises
`DistributedSyncError`. θ is the sync set only (the trainable parameters; after a Streaming
DiLoCo round, only the fragment it mixed in, named in DONE's payload): frozen
weights are the same on every rank by construction. Messages are a fixed int64 tensor
plus an optional JSON byte tensor: nothing is pickled (`broadcast_object_list` would).

Stopping: a SIGTERM (or Ctrl+C) reaches every rank, which stops like any `fedtrain`
command: "fedtrain participant: stopped", status 130, no traceback. torchrun's own
launcher then prints torch's `SignalException` traceback, in its process, which no code of
ours runs in; `launch` runs that launcher in our process and ends it with one line instead.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from fedtrain.config import RunConfig
from fedtrain.errors import FedtrainError
from fedtrain.participant.runner import Participant, sync_set
from fedtrain.participant.shards import is_sharded

__all__ = ["DistributedParticipant", "DistributedSyncError", "init_from_env", "launch", "world_from_env"]

log = logging.getLogger("fedtrain.participant")

T = TypeVar("T")

WAIT, READY, DONE, ERROR = 1, 2, 3, 4
_FIELDS = 5  # kind, round, flags, sync_every, payload length
_PARAMS = 2  # flag: θ follows (bit 0 is `finished`)


class DistributedSyncError(FedtrainError):
    """Rank 0 failed to join or sync; every rank of the participant stops with its message."""


def world_from_env() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them; (0, 1) outside torchrun."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def init_from_env(device: str = "cpu") -> tuple[int, int, torch.device]:
    """Join the torchrun group when there is one: (rank, world size, this rank's device).

    `device` "cuda" takes the GPU of LOCAL_RANK and the NCCL backend; "cpu" takes gloo.
    Outside torchrun nothing is initialised and the answer is (0, 1, device)."""
    rank, world = world_from_env()
    if device == "cuda":
        if not torch.cuda.is_available():
            raise FedtrainError("--device cuda, but torch sees no CUDA device")
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(where)
    else:
        where = torch.device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if where.type == "cuda" else "gloo")
    return rank, world, where


def launch(argv: Sequence[str], prog: str = "fedtrain torchrun") -> int:
    """torchrun in this process (`argv` as torchrun takes them), ending as a `fedtrain` command does.

    On SIGTERM, SIGINT or SIGHUP torchrun's agent passes the signal on to the ranks, waits
    for them, then raises `SignalException`; uncaught, as under `torchrun`, that prints a
    traceback after the ranks' own clean stop. Here it is one line and status 130. A failed
    rank (`ChildFailedError`) prints torch's failure summary without the traceback, status 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    try:
        main(list(argv))
    except (SignalException, KeyboardInterrupt) as e:  # KeyboardInterrupt: before the agent's handlers are set
        why = f" ({e.sigval.name})" if isinstance(e, SignalException) else ""
        print(f"{prog}: stopped{why}", file=sys.stderr)
        return 130
    except ChildFailedError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


@dataclass
class _Message:
    kind: int
    round: int
    finished: bool
    with_params: bool
    sync_every: int
    payload: dict[str, Any]


class DistributedParticipant:
    """A `Participant` spread over a torch.distributed group; rank 0 speaks HTTP.

    Construct it on every rank with the same arguments; on rank 0 it calls
    `make_participant()` to build the `Participant` (the other ranks never call it).
    `model` is the plain module (not the DDP wrapper): its trainable parameters are the
    sync set. With NCCL, pass `device` (the rank's GPU) for the control messages. Its join
    tells the coordinator what it is: `info` `parallel` "ddp" and `world_size` the group's ranks.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        make_participant: Callable[[], Participant] | None,
        group: dist.ProcessGroup | None = None,
        keepalive_s: float = 5.0,
        device: torch.device | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise FedtrainError("DistributedParticipant needs torch.distributed initialised (run under torchrun)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.keepalive_s = keepalive_s
        self.device = device or torch.device("cpu")
        self.fed: Participant | None = None
        if self.rank == 0:
            if make_participant is None:
                raise FedtrainError("rank 0 needs make_participant to build its Participant")
            fed = make_participant()
            # The coordinator shows the group as one participant of `world_size` ranks (`coordinator/ranks.py`);
            # set before `__enter__` joins, on a copy: the caller's info dict stays as it was.
            fed.info = {**fed.info, "parallel": "ddp", "world_size": self.world_size}
            self.fed = fed
        self._params = sync_set(model)
        if is_sharded(self._params):
            raise FedtrainError("the model is sharded (fully_shard): use FsdpParticipant, whose ranks sync "
                                "their own shards")
        self._names = sorted(self._params)
        self.config = RunConfig()
        self.round = 0
        self.finished = False
        self.sync_every = 1
        self.steps = 0
        self.tokens = 0
        self._round_steps = 0
        self._pending_tokens = 0
        self._pending_loss = 0.0
        self._pending_losses = 0

    # -- the loop-facing surface ------------------------------------------------------------

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.fed.history if self.fed is not None else []

    @property
    def participant_id(self) -> str:
        return self.fed.participant_id if self.fed is not None else f"rank-{self.rank}"

    def __enter__(self) -> DistributedParticipant:
        if self.fed is not None:
            self._lead(self.fed.__enter__)
            self._announce(READY, True)
        else:
            self._follow()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fed is not None:
            self.fed.__exit__(*exc)

    def step(self, tokens: int, loss: float | None = None) -> bool:
        """Count one inner step on this rank; returns True when the group synced at this step.

        Below H steps into a round the inner `Participant` cannot sync, so rank 0 just
        counts. From the H-th step on, every step is a sync point that every rank enters:
        the tokens are all-reduced, rank 0 steps its `Participant` (which syncs, or, while
        the coordinator is unreachable, keeps training and retries on a later step) and
        broadcasts the outcome, then the new weights if it synced."""
        if self.finished:
            return False
        self.steps += 1
        self._round_steps += 1
        self._pending_tokens += tokens
        if loss is not None:
            self._pending_loss += float(loss)
            self._pending_losses += 1
        if self._round_steps < self.sync_every:
            if self.fed is not None:
                self.fed.step(tokens=int(self._take_pending()[0]), loss=loss)  # below H: counts, never syncs
            return False
        sums = torch.tensor(self._take_pending(), dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, group=self.group)
        group_tokens = int(sums[0].item())
        self.tokens += group_tokens
        if self.fed is not None:
            fed = self.fed
            mean = float(sums[1] / sums[2]) if sums[2] > 0 else loss
            synced = bool(self._lead(lambda: fed.step(tokens=group_tokens, loss=mean)))
            self._announce(DONE, synced)
        else:
            synced = self._follow()
        if synced:
            self._round_steps = 0
        return synced

    def _take_pending(self) -> tuple[float, float, float]:
        """The tokens and losses this rank has not handed over yet (rank 0 hands them to its
        Participant every step, the others at the next sync point)."""
        out = (float(self._pending_tokens), self._pending_loss, float(self._pending_losses))
        self._pending_tokens, self._pending_loss, self._pending_losses = 0, 0.0, 0
        return out

    # -- rank 0 --------------------------------------------------------------------------------

    def _lead(self, work: Callable[[], T]) -> T:
        """Run `work` (HTTP) in a thread, broadcasting WAIT until it ends; a failure is
        broadcast as ERROR and raised here too."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = work()
            except BaseException as e:  # noqa: BLE001 - reported to every rank, then re-raised below
                box["error"] = e

        worker = threading.Thread(target=run, name="fedtrain-rank0-sync", daemon=True)
        worker.start()
        while True:
            worker.join(self.keepalive_s)
            if not worker.is_alive():
                break
            self._send(WAIT, False, {})
        error = box.get("error")
        if error is not None:
            message = getattr(error, "message", None) or f"{type(error).__name__}: {error}"
            self._send(ERROR, False, {"error": str(message)})
            raise error
        return box.get("result")  # type: ignore[return-value]

    def _announce(self, kind: int, with_params: bool) -> None:
        """Tell every rank the state after a join or a sync point; then θ if it changed."""
        fed = self.fed
        assert fed is not None
        self._adopt(fed.round, fed.finished, fed.sync_every, fed.config)
        payload: dict[str, Any] = {"config": fed.config.model_dump(mode="json")} if with_params else {}
        changed = self._changed(fed.changed) if with_params and kind == DONE else None
        if changed is not None:  # Streaming DiLoCo: only the fragment just mixed in moved
            payload["changed"] = changed
        self._send(kind, with_params, payload)
        if with_params:
            self._broadcast_params(changed)

    def _send(self, kind: int, with_params: bool, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode() if payload else b""
        flags = int(self.finished) | (_PARAMS if with_params else 0)
        head = torch.tensor(
            [kind, self.round, flags, self.sync_every, len(data)], dtype=torch.int64, device=self.device
        )
        dist.broadcast(head, src=0, group=self.group)
        if data:
            body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            dist.broadcast(body, src=0, group=self.group)

    # -- other ranks ---------------------------------------------------------------------------

    def _receive(self) -> _Message:
        head = torch.zeros(_FIELDS, dtype=torch.int64, device=self.device)
        dist.broadcast(head, src=0, group=self.group)
        kind, round_, flags, sync_every, length = (int(v) for v in head.tolist())
        payload: dict[str, Any] = {}
        if length:
            body = torch.empty(length, dtype=torch.uint8, device=self.device)
            dist.broadcast(body, src=0, group=self.group)
            payload = json.loads(body.cpu().numpy().tobytes().decode())
        return _Message(kind, round_, bool(flags & 1), bool(flags & _PARAMS), sync_every, payload)

    def _follow(self) -> bool:
        """Wait for rank 0's outcome; returns whether new weights came (a sync happened)."""
        while True:
            msg = self._receive()
            if msg.kind == WAIT:
                continue
            if msg.kind == ERROR:
                raise DistributedSyncError(f"rank 0 of this participant failed: {msg.payload.get('error')}")
            config = RunConfig.model_validate(msg.payload["config"]) if "config" in msg.payload else self.config
            self._adopt(msg.round, msg.finished, msg.sync_every, config)
            if msg.with_params:
                self._broadcast_params(msg.payload.get("changed"))
            return msg.with_params

    # -- both ----------------------------------------------------------------------------------

    def _adopt(self, round_: int, finished: bool, sync_every: int, config: RunConfig) -> None:
        self.round, self.finished, self.sync_every, self.config = round_, finished, sync_every, config

    def _changed(self, names: list[str] | None) -> list[int] | None:
        """The positions (in name order) of the tensors a sync changed; None: all of them."""
        if names is None:
            return None
        where = {n: i for i, n in enumerate(self._names)}
        return sorted(where[n] for n in names)

    def _broadcast_params(self, only: list[int] | None = None) -> None:
        """θ from rank 0 to every rank, tensor by tensor in name order, in place: all of it, or
        the tensors at positions `only` (a streaming fragment's)."""
        keep = None if only is None else set(only)
        with torch.no_grad():
            for i, name in enumerate(self._names):
                if keep is None or i in keep:
                    dist.broadcast(self._params[name].data, src=0, group=self.group)
