"""A participant's local checkpoint at round boundaries: inner optimizer state, upload residual, data
position, counters.

A participant killed and restarted rejoins at the coordinator's current round and takes
the global weights from it; what only the participant knows is kept here: the inner
optimizer's state (AdamW moments and step counts), the residual of its upload error
feedback (what compressed uploads have not sent yet), the position of its data stream, its
step and token counters, and any JSON-able state of the user's loop. Saving at a round
boundary makes the set consistent (the weights then are exactly a global version).

Files (no pickle anywhere; nothing here calls `torch.load`):

    DIR/optimizer-<round>.safetensors   every tensor of optimizer.state_dict()["state"]
    DIR/residual-<round>.safetensors    the upload residual (only when there is one)
    DIR/state.json                      the rest: param groups, scalars, counters, user state,
                                        and the name and sha256 digest of each tensor file

All are written atomically (temp file, fsync, rename); state.json last, so that it
always names complete tensor files of one round; older tensor files are removed after.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fedtrain.errors import FedtrainError, StateError
from fedtrain.wire import iter_file, read_tensors, write_file

__all__ = ["LocalCheckpoint", "optimizer_state_from_files", "optimizer_state_to_files"]

log = logging.getLogger("fedtrain.participant")

_STATE_FILE = "state.json"
_FORMAT = 1


def optimizer_state_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split `optimizer.state_dict()` into tensors (`state/<param>/<key>`) and JSON-able rest."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in sd["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{index}/{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    groups = json.loads(json.dumps(sd["param_groups"]))  # tuples (betas) become lists; fails on the non-JSON-able
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_state_from_files(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `optimizer_state_to_files`: a dict for `optimizer.load_state_dict`."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        _, index, key = name.split("/", 2)
        state.setdefault(int(index), {})[key] = value
    for index, values in meta.get("scalars", {}).items():
        state.setdefault(int(index), {}).update(values)
    groups = meta["param_groups"]
    for group in groups:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": groups}


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    """`data` as JSON in `path`, replaced whole: a temp file (mode 600), fsync, rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class LocalCheckpoint:
    """The checkpoint directory of one participant (one per rank under torchrun)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)

    def exists(self) -> bool:
        return (self.dir / _STATE_FILE).is_file()

    def save(
        self,
        *,
        round_: int,
        optimizer: torch.optim.Optimizer | None,
        steps: int = 0,
        tokens: int = 0,
        user_state: dict[str, Any] | None = None,
        residual: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Write the state after the sync that started round `round_`; `residual`: the
        participant's upload residual (`Participant.upload_residual()`), if any."""
        self.dir.mkdir(parents=True, exist_ok=True)
        record: dict[str, Any] = {
            "format": _FORMAT,
            "round": round_,
            "steps": steps,
            "tokens": tokens,
            "user_state": user_state or {},
        }
        if optimizer is not None:
            tensors, meta = optimizer_state_to_files(optimizer)
            name = f"optimizer-{round_}.safetensors"
            digest = write_file(self.dir / name, tensors, {"format": str(_FORMAT)})
            record["optimizer"] = {"file": name, "digest": digest, **meta}
        if residual:
            name = f"residual-{round_}.safetensors"
            held = {n: t.detach().to("cpu").contiguous() for n, t in residual.items()}
            record["residual"] = {"file": name, "digest": write_file(self.dir / name, held, {"format": str(_FORMAT)})}
        write_json_atomically(self.dir / _STATE_FILE, record)
        for kind in ("optimizer", "residual"):
            keep = record.get(kind, {}).get("file")
            for old in self.dir.glob(f"{kind}-*.safetensors"):
                if old.name != keep:
                    old.unlink(missing_ok=True)

    def load(self, optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
        """Restore the optimizer state in place; return the record (round, steps, tokens,
        user_state), or None when there is no checkpoint yet."""
        path = self.dir / _STATE_FILE
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
            if record.get("format") != _FORMAT:
                raise StateError(f"{path}: unknown checkpoint format {record.get('format')!r}")
            saved = record.get("optimizer")
            if optimizer is not None and saved is not None:
                tensors = dict(read_tensors(iter_file(self.dir / saved["file"]), expected_digest=saved["digest"]))
                optimizer.load_state_dict(optimizer_state_from_files(tensors, saved))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StateError(f"the participant checkpoint in {self.dir} cannot be restored: {e}") from None
        except FedtrainError as e:
            raise StateError(f"the participant checkpoint in {self.dir} cannot be restored: {e.message}") from None
        return record

    def load_residual(self) -> dict[str, torch.Tensor] | None:
        """The upload residual the checkpoint holds, checked against its digest; None when it
        holds none, or when its file is missing or damaged (logged: the error feedback then
        starts from zero, which loses only the signal it held back)."""
        path = self.dir / _STATE_FILE
        try:
            saved = json.loads(path.read_text()).get("residual") if path.is_file() else None
            if saved is None:
                return None
            return dict(read_tensors(iter_file(self.dir / saved["file"]), expected_digest=saved["digest"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("the upload residual in %s cannot be read (%s): error feedback starts from zero", self.dir, e)
        except FedtrainError as e:
            log.warning("the upload residual in %s cannot be read (%s): error feedback starts from zero",
                        self.dir, e.message)
        return None
