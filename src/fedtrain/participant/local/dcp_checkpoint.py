"""A sharded participant's checkpoint at round boundaries, through torch.distributed.checkpoint
(DCP): inner optimizer state, data position and counters of an FSDP2 group, written atomically,
loadable on another number of ranks, with no pickle on disk or between ranks (safetensors and
JSON). See docs/architecture.md and docs/training-jobs.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from fedtrain import faults
from fedtrain.errors import FedtrainError, StateError
from fedtrain.participant.local.checkpoint import write_json_atomically
from fedtrain.participant.ranks.control import RankGroup
from fedtrain.wire.files import fsync_dir

__all__ = ["DcpCheckpoint"]

log = logging.getLogger("fedtrain.participant")

_FORMAT = 1
_KIND = "fedtrain-dcp"
_STATE_FILE = "state.json"
_PARTIAL = ".partial-"
_ROUND = "round-"


def _rank_writer(path: Path, rank: int) -> Any:
    """DCP's safetensors writer, naming the file by the rank as its collective plan would (1 + rank)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    class RankFileWriter(HuggingFaceStorageWriter):
        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            # Without collectives the global plan is this rank's alone; its file takes the rank's index.
            return [dataclasses.replace(p, storage_data={"shard_index": rank + 1}) for p in plans]

    return RankFileWriter(str(path), save_distributed=True)


def _split_state(optimizer_state: dict[str, Any], rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`get_optimizer_state_dict`'s "state" as flat tensors (`state/<fqn>/<key>`) and JSON-able rest.
    A tensor that is not a DTensor is the same on every rank: only rank 0 keeps it."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, entry in optimizer_state.items():
        for key, value in entry.items():
            if isinstance(value, DTensor) or (isinstance(value, torch.Tensor) and rank == 0):
                tensors[f"state/{fqn}/{key}"] = value
            elif not isinstance(value, torch.Tensor):
                scalars.setdefault(fqn, {})[key] = value
    return tensors, json.loads(json.dumps(scalars))  # fails here on what JSON cannot hold


def _groups_json(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return list(json.loads(json.dumps(groups)))  # tuples (betas) become lists


class DcpCheckpoint:
    """The checkpoint directory of one sharded participant (see the module docstring).

    Construct it on every rank with the same directory and the `fully_shard`ed model; `save`
    and `load` are collective: every rank calls them at the same point."""

    def __init__(self, directory: str | Path, model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise FedtrainError("a DCP checkpoint needs torch.distributed initialised (run under torchrun)")
        try:
            from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter  # noqa: F401
        except ImportError:
            raise FedtrainError(f"a sharded checkpoint needs DCP's safetensors storage (tested with torch 2.13), "
                                f"which torch {torch.__version__} lacks") from None
        self.dir = Path(directory)
        self.model = model
        self.group = group
        self.ranks = RankGroup(group)  # agreements travel on the control group (gloo): NCCL takes no CPU tensors
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    # -- what is on disk ---------------------------------------------------------------------

    def latest(self) -> Path | None:
        """The newest complete checkpoint (a `round-<r>` directory whose state.json checks), or None."""
        found: list[tuple[int, Path]] = []
        for entry in self.dir.glob(f"{_ROUND}*"):
            try:
                found.append((int(entry.name[len(_ROUND):]), entry))
            except ValueError:
                continue
        for _, path in sorted(found, reverse=True):
            if self._complete(path):
                return path
            log.warning("skipping the incomplete checkpoint %s", path)
        return None

    @staticmethod
    def _complete(path: Path) -> bool:
        try:
            record = json.loads((path / _STATE_FILE).read_text())
            files = record["files"]
            return record.get("kind") == _KIND and all(
                (path / "optimizer" / name).stat().st_size == size for name, size in files.items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False

    # -- save --------------------------------------------------------------------------------

    def save(self, *, round_: int, optimizer: torch.optim.Optimizer, steps: int = 0, tokens: int = 0,
             user_state: dict[str, Any] | None = None) -> Path:
        """Write the state after the sync that started round `round_` (collective); returns its directory."""
        partial = self.dir / f"{_PARTIAL}{round_}"
        self._agree("prepare", self._try(lambda: self._prepare(partial)) if self.rank == 0 else None)
        groups: list[dict[str, Any]] = []
        scalars: dict[str, Any] = {}

        def write() -> None:
            nonlocal groups, scalars
            from torch.distributed.checkpoint import save
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            sd: Any = get_optimizer_state_dict(self.model, optimizer)
            tensors, scalars = _split_state(sd["state"], self.rank)
            groups = _groups_json(sd["param_groups"])
            save(tensors, storage_writer=_rank_writer(partial / "optimizer", self.rank), use_collectives=False)
            write_json_atomically(partial / f"data-rank{self.rank}.json", user_state or {})

        self._agree("write", self._try(write))
        final = self.dir / f"{_ROUND}{round_}"
        if self.rank == 0:
            record = {"format": _FORMAT, "kind": _KIND, "round": round_, "steps": steps, "tokens": tokens,
                      "world_size": self.world_size, "param_groups": groups, "scalars": scalars}
            self._agree("commit", self._try(lambda: self._commit(partial, final, record)))
        else:
            self._agree("commit", None)
        return final

    def _prepare(self, partial: Path) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for leftover in self.dir.glob(f"{_PARTIAL}*"):  # checkpoints cut off before: never loaded
            shutil.rmtree(leftover, ignore_errors=True)
        (partial / "optimizer").mkdir(parents=True)

    def _commit(self, partial: Path, final: Path, record: dict[str, Any]) -> None:
        """state.json last, then the rename; the older checkpoints go only once this one is complete."""
        faults.hit("participant.checkpoint", round=record["round"])
        shards = partial / "optimizer"
        record["files"] = {f.name: f.stat().st_size for f in sorted(shards.glob("*.safetensors"))}
        write_json_atomically(partial / _STATE_FILE, record)
        stale = None
        if final.exists():  # the same round saved again (a restart that did not get further)
            stale = self.dir / f"{_PARTIAL}stale-{final.name}"
            os.replace(final, stale)
        os.replace(partial, final)
        fsync_dir(self.dir)
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
        for old in self.dir.glob(f"{_ROUND}*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)

    # -- load --------------------------------------------------------------------------------

    def load(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """Restore the optimizer state of the newest complete checkpoint into this layout (collective).

        Returns the record (round, steps, tokens, world_size, and this rank's user_state: {} for a
        rank that the checkpoint's world did not have), or None when there is no checkpoint."""
        chosen: dict[str, Any] = {}
        if self.rank == 0:
            error = self._try(lambda: chosen.update(self._choose()))
            chosen = {"error": error} if error else chosen
        chosen = self.ranks.broadcast_json(chosen)
        if "error" in chosen:
            raise StateError(f"the participant checkpoint in {self.dir} cannot be read: {chosen['error']}")
        if not chosen:
            return None
        path = self.dir / chosen["name"]
        record = chosen["record"]
        user_state: dict[str, Any] = {}

        def read() -> None:
            nonlocal user_state
            self._restore(path, record, optimizer)
            own = path / f"data-rank{self.rank}.json"
            user_state = dict(json.loads(own.read_text())) if own.is_file() else {}

        self._agree("restore", self._try(read), what=f"the participant checkpoint in {path} cannot be restored")
        log.info("rank %d restored the optimizer state of %s (written by %d ranks, now %d)%s", self.rank, path.name,
                 record["world_size"], self.world_size, "" if user_state else "; no saved data position here")
        return {**{k: record[k] for k in ("round", "steps", "tokens", "world_size")}, "user_state": user_state}

    def _choose(self) -> dict[str, Any]:
        path = self.latest()
        if path is None:
            return {}
        record = json.loads((path / _STATE_FILE).read_text())
        if record.get("format") != _FORMAT:
            raise StateError(f"{path}: unknown checkpoint format {record.get('format')!r}")
        return {"name": path.name, "record": record}

    def _restore(self, path: Path, record: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint import HuggingFaceStorageReader, load
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        sd: Any = get_optimizer_state_dict(self.model, optimizer)  # this layout's state (initialised if empty)
        wanted: dict[str, torch.Tensor] = {}
        for fqn, entry in sd["state"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    wanted[f"state/{fqn}/{key}"] = value
        with warnings.catch_warnings():  # no_dist is on purpose (see the module docstring): not worth a warning
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            load(wanted, storage_reader=HuggingFaceStorageReader(str(path / "optimizer")), no_dist=True)
        for fqn, values in record["scalars"].items():
            if fqn not in sd["state"]:
                raise StateError(f"the checkpoint has optimizer state for {fqn}, which this model does not train")
            sd["state"][fqn].update(values)
        saved_groups = record["param_groups"]
        groups = sd["param_groups"]
        if [g["params"] for g in saved_groups] != [list(g["params"]) for g in groups]:
            raise StateError("the checkpoint's optimizer parameter groups are not this model's")
        for group, saved in zip(groups, saved_groups, strict=True):
            for key, value in saved.items():
                if key != "params":
                    group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        set_optimizer_state_dict(self.model, optimizer, sd)

    # -- the ranks agree ---------------------------------------------------------------------

    @staticmethod
    def _try(work: Callable[[], object]) -> str | None:
        """Run `work`; its failure as a message, which every rank then learns in `_agree`."""
        try:
            work()
        except FedtrainError as e:
            return e.message
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a failure that escaped one rank would
            return f"{type(e).__name__}: {e}"  # leave the others waiting in the next collective
        return None

    def _agree(self, step: str, error: str | None, what: str | None = None) -> None:
        """Every rank learns whether any rank failed `step`; all raise together, so that none waits."""
        failed = self.ranks.sum([float(k == self.rank and error is not None) for k in range(self.world_size)])
        ranks = [k for k in range(self.world_size) if failed[k]]
        if not ranks:
            return
        why = error if error is not None else f"rank {', '.join(map(str, ranks))} failed"
        raise StateError(f"{what or f'the participant checkpoint in {self.dir} cannot be written'} "
                         f"({step}): {why}")
