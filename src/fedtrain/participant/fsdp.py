"""FSDP participants: one federated participant whose ranks each sync their own shard.

A model sharded with FSDP2 (`fully_shard`, under torchrun) is one participant: rank 0 joins
and sends heartbeats; every rank holds the snapshot of its own rows only (`shards.py`),
uploads Δ of those rows itself as its piece of the participant's update (`piece=rank<k>`,
in parallel with the other ranks), and downloads only its rows of the new global model
(`GET /v1/model?rows=`) into its local shard. No rank ever holds the whole model: no
`full_tensor()`, no gather. The coordinator counts the update once the pieces cover the
sync set (`coordinator/pieces.py`); all pieces carry the group's token count.

Every collective is entered by every rank in the same order, and every decision is drawn
from values every rank holds after a collective, or broadcast from rank 0:

    enter:   TOGETHER(rank 0 joins) ── JSON(id, key, round, config | error) ── TOGETHER(download rows)
    step:    below H nothing; at H: ALL_REDUCE(tokens, loss) ── TOGETHER(upload piece, wait for
             the round, download rows; rank 0 also fetches the next round's config)
             ── ALL_REDUCE(versions) ── JSON(config | error)

TOGETHER runs the rank's HTTP work on a worker thread and, every `keepalive_s` until every
rank's work has ended, all-reduces (running, failed per rank): so no rank sits in one
collective long enough to hit the process group's timeout, every rank leaves the loop at
the same all-reduce, and a failure on any rank stops every rank (`DistributedSyncError`).
The participant key travels inside the job's process group (same site), never pickled.

Not yet (issue #20's later steps): riding out an outage (a failed sync stops the group),
compressed pieces, the overlapped sync, distributed checkpoints and the CLI's `--parallel fsdp`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fedtrain.config import RunConfig
from fedtrain.errors import CoordinatorUnavailable, FedtrainError, MergeError, ModelMismatchError
from fedtrain.merge import check_compatible
from fedtrain.participant.client import CoordinatorClient
from fedtrain.participant.distributed import DistributedSyncError
from fedtrain.participant.presence import Presence
from fedtrain.participant.runner import EvalFn, sync_set
from fedtrain.participant.shards import local_tensor, shard_layout
from fedtrain.wire import ST_TO_DTYPE, EncodedBody, TensorSpec
from fedtrain.wire.format import ROWS_META

__all__ = ["FsdpParticipant"]

log = logging.getLogger("fedtrain.participant")


class FsdpParticipant:
    """A participant made of the ranks of an FSDP2 job, each syncing its own shard.

    Construct it on every rank with the same arguments and a `CoordinatorClient` of the
    rank's own; `model` is the `fully_shard`ed module (its trainable parameters are the
    sync set). The loop-facing surface is `Participant`'s: `step`, `finished`, `round`,
    `config`, `sync_every`, `history` (rank 0's)."""

    def __init__(self, model: nn.Module, *, client: CoordinatorClient, name: str | None = None,
                 info: dict[str, Any] | None = None, eval_fn: EvalFn | None = None,
                 inner_optimizer: torch.optim.Optimizer | None = None, key_file: str | Path | None = None,
                 group: dist.ProcessGroup | None = None, keepalive_s: float = 5.0,
                 patience_s: float = 60.0) -> None:
        if not dist.is_initialized():
            raise FedtrainError("FsdpParticipant needs torch.distributed initialised (run under torchrun)")
        self.client = client
        self.name = name
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.info = {**(info or {}), "parallel": "fsdp", "world_size": self.world_size}
        self.model = model
        self.eval_fn = eval_fn
        self.inner_optimizer = inner_optimizer
        self.key_file = Path(key_file) if key_file is not None and self.rank == 0 else None
        self.keepalive_s = keepalive_s
        self.patience_s = patience_s
        self._params = sync_set(model)
        self._layout = shard_layout(self._params)
        # What this rank sends and fetches: its non-empty rows, and (rank 0) the replicated tensors.
        self._mine = {n: s for n, s in self._layout.items() if not s.empty and (self.rank == 0 or not s.whole)}
        self._fetch = {n: s for n, s in self._layout.items() if not s.empty}
        self._snapshot: dict[str, torch.Tensor] = {}
        self._version = -1  # the global version of the snapshot's last download (-1: none: no rows here)
        self.participant_id = ""
        self.config = RunConfig()
        self.round = 0
        self.finished = False
        self.steps = 0
        self.tokens = 0
        self.history: list[dict[str, Any]] = []
        self._round_steps = 0
        self._pending = [0.0, 0.0, 0.0]  # tokens, loss sum, loss count not yet all-reduced
        self._presence: Presence | None = None
        if self.rank == 0:
            self._presence = Presence(client, interval_s=lambda: self.config.heartbeat_interval_s,
                                      stats=lambda: {"step": self.steps, "round": self.round})

    @property
    def sync_every(self) -> int:
        return self.config.train.sync_every

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's snapshot: its rows of the sync set."""
        return sum(t.numel() * t.element_size() for t in self._snapshot.values())

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> FsdpParticipant:
        joined = self._together(self._join if self.rank == 0 else None)
        answer = self._broadcast_json(self._joined_message(joined) if self.rank == 0 else None)
        self.participant_id = answer["participant_id"]
        self.client.remember_key(self.participant_id, answer["participant_key"])
        self.config = RunConfig.model_validate(answer["config"])
        version = int(answer["round"])
        self._snapshot = {n: torch.empty(tuple(local_tensor(self._params[n]).shape),
                                         dtype=self._params[n].dtype) for n in self._fetch}
        self._together(lambda: self._download(version=version))
        self._adopt(version)
        if self._presence is not None:
            self._presence.start(self.participant_id)
        log.info("rank %d of %s joined at round %d, holding %d bytes of the sync set", self.rank,
                 self.participant_id, self.round, self.shard_bytes)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._presence is not None:
            self._presence.stop()
            try:
                self.client.leave(self.participant_id, retry=self.client.retry.within(2.0))
            except FedtrainError as e:
                log.info("could not say goodbye to the coordinator: %s", e)
        self.client.close()

    # -- the user's loop -------------------------------------------------------------------

    def step(self, tokens: int, loss: float | None = None) -> bool:
        """Count one inner step on this rank; at the H-th step of a round every rank syncs
        its shard (see the module docstring). Returns True when the group synced."""
        if self.finished:
            return False
        self.steps += 1
        self._round_steps += 1
        self._pending[0] += tokens
        if loss is not None:
            self._pending[1] += float(loss)
            self._pending[2] += 1
        if self._round_steps < self.sync_every:
            return False
        sums = torch.tensor(self._pending, dtype=torch.float64)
        self._pending = [0.0, 0.0, 0.0]
        dist.all_reduce(sums, group=self.group)
        group_tokens = max(1, int(sums[0].item()))
        self.tokens += group_tokens
        r = self.round
        t0 = time.perf_counter()
        piece, config = self._together(lambda: self._exchange(r, group_tokens))
        version = self._agreed_version(int(self._version))
        answer = self._broadcast_json({"config": config} if self.rank == 0 else None)
        self.config = RunConfig.model_validate(answer["config"])
        self._adopt(version)
        self._round_steps = 0
        record: dict[str, Any] = {"round": r, "tokens": group_tokens, "sync_s": time.perf_counter() - t0,
                                  "piece": piece}
        if sums[2] > 0:
            record["train_loss"] = float(sums[1] / sums[2])
        self.history.append(record)
        return True

    # -- the HTTP work of one rank (on the worker thread of `_together`) ---------------------

    def _join(self) -> dict[str, Any]:
        joined = self.client.join(self.name, self.info)
        self._check_model(joined["model"])
        return joined

    def _joined_message(self, joined: dict[str, Any]) -> dict[str, Any]:
        pid = joined["participant_id"]
        return {"participant_id": pid, "participant_key": self.client.participant_key(pid) or "",
                "config": joined["config"], "round": int(joined["current_round"])}

    def _exchange(self, r: int, tokens: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """Upload this rank's piece of round r, wait for the round to close, download our rows
        of the new global model (into the snapshot). Returns the coordinator's answer to our
        piece (None: no rows here) and, on rank 0, the config in force in the new round."""
        answer = None
        config = self.config
        with torch.no_grad():
            delta = {n: self._snapshot[n] - local_tensor(self._params[n]).detach().cpu() for n in self._mine}
        if delta:
            rows = {n: s.rows() for n, s in self._mine.items() if not s.whole}
            body = EncodedBody(delta, {ROWS_META: json.dumps(rows)}, digest_algorithm=config.digest)
            answer = self.client.upload(r, self.participant_id, body, tokens=tokens, piece=f"rank{self.rank}")
        give_up_at = time.monotonic() + config.round_timeout_s + self.patience_s
        while True:
            info = self.client.wait_round(r, self.participant_id, wait_s=25.0)
            if info["state"] not in ("open", "closing"):
                break
            if time.monotonic() > give_up_at:
                raise CoordinatorUnavailable(f"round {r} has not closed {config.round_timeout_s:g}s after its "
                                             f"deadline: {info.get('reason', 'no reason given')}",
                                             status=0, code="unavailable")
        self._download()
        if self.rank != 0:
            return answer, None
        return answer, dict(self.client.get_config(round_=self._version)["config"])

    def _download(self, version: int | None = None) -> None:
        """Our rows of the global model (the latest, or `version`) into the snapshot."""
        self._version = -1
        if not self._fetch:  # this rank holds no row of any tensor
            return
        rows = {n: s.rows() for n, s in self._fetch.items()}
        got, _ = self.client.download(version=version, pid=self.participant_id, rows=rows,
                                      allocate=self._allocate)
        self._version = int(got)

    def _allocate(self, spec: TensorSpec) -> torch.Tensor:
        buffer = self._snapshot.get(spec.name)
        if buffer is None or tuple(buffer.shape) != tuple(spec.shape) or buffer.dtype != spec.dtype:
            raise ModelMismatchError(f"the coordinator sent {spec.name} {tuple(spec.shape)}, not our rows of it")
        return buffer

    def _check_model(self, spec: dict[str, dict[str, Any]]) -> None:
        run = {n: (ST_TO_DTYPE[s["dtype"]], tuple(s["shape"])) for n, s in spec.items()}
        ours = {n: (p.dtype, tuple(p.shape)) for n, p in self._params.items()}  # a DTensor's shape is global
        try:
            check_compatible(run, ours, what="your model")
        except MergeError as e:
            raise ModelMismatchError(f"{e.message} (the run's model is the reference)", details=e.details) from None

    # -- collectives -------------------------------------------------------------------------

    def _adopt(self, version: int) -> None:
        """The snapshot (our rows of global version `version`) into the local shards."""
        with torch.no_grad():
            for n in self._fetch:
                local_tensor(self._params[n]).copy_(self._snapshot[n])
        self.round = version
        self.finished = self.config.rounds > 0 and version >= self.config.rounds

    def _together(self, work: Callable[[], Any] | None) -> Any:
        """Run `work` (this rank's HTTP, or nothing) on a thread while every rank all-reduces
        (running, failed per rank) every `keepalive_s`; raise on every rank if one failed."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = work() if work is not None else None
            except BaseException as e:  # noqa: BLE001 - every rank learns of it below, then it is raised
                box["error"] = e

        worker = threading.Thread(target=run, name=f"fedtrain-rank{self.rank}-sync", daemon=True)
        worker.start()
        while True:
            worker.join(self.keepalive_s)
            state = torch.zeros(1 + self.world_size, dtype=torch.int64)
            state[0] = int(worker.is_alive())
            state[1 + self.rank] = int(not worker.is_alive() and "error" in box)
            dist.all_reduce(state, group=self.group)
            if state[0] == 0:
                break
        failed = [k for k in range(self.world_size) if state[1 + k]]
        if "error" in box:
            raise box["error"]
        if failed:
            raise DistributedSyncError(f"rank {', '.join(map(str, failed))} of this participant failed its sync")
        return box.get("result")

    def _agreed_version(self, version: int) -> int:
        """Rank 0's global version, checked against every rank's download (-1: none)."""
        seen = torch.tensor([version, -version if version >= 0 else -(1 << 62)], dtype=torch.int64)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.group)
        if int(seen[0]) != -int(seen[1]):
            raise DistributedSyncError(f"the ranks of this participant downloaded different global versions "
                                       f"({-int(seen[1])} to {int(seen[0])})")
        return int(seen[0])

    def _broadcast_json(self, payload: dict[str, Any] | None) -> dict[str, Any]:
        """`payload` from rank 0 to every rank, as bytes (no pickle)."""
        data = json.dumps(payload).encode() if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(body, src=0, group=self.group)
        return dict(json.loads(body.numpy().tobytes().decode()))

