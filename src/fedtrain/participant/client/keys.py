"""Joining as oneself: the participant key a join answer carries, kept in a key file (mode
600) so that a participant restarted with the same file rejoins as itself at once."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fedtrain.participant.client.coordinator_client import CoordinatorClient

__all__ = ["join_as"]

log = logging.getLogger("fedtrain.participant")


def join_as(client: CoordinatorClient, name: str | None, info: dict[str, Any],
            key_file: Path | None, model: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Join the run; with `key_file`, as the participant whose key it keeps (and keep the
    key of this join there); `model` as `CoordinatorClient.join`'s. Returns the join answer."""
    saved = _read_key_file(key_file) if key_file is not None else None
    if saved is not None and name in (None, saved[0]):  # rejoin as itself, under the name it had
        name = saved[0]
        client.remember_key(*saved)
    joined = client.join(name, info, model=model)
    pid = joined["participant_id"]
    key = client.participant_key(pid)
    if key_file is not None and key is not None and saved != (pid, key):
        _write_key_file(key_file, pid, key)
    return joined


def _read_key_file(path: Path) -> tuple[str, str] | None:
    """(participant id, participant key) kept in `path`, or None when there is none to use."""
    try:
        data = json.loads(path.read_text())
        pid, key = data["participant_id"], data["participant_key"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the participant key file %s: %s", path, e)
        return None
    return (pid, key) if isinstance(pid, str) and isinstance(key, str) else None


def _write_key_file(path: Path, pid: str, key: str) -> None:
    """Keep `key` in `path`, readable by its owner only (mkstemp's mode 600), replaced whole."""
    from fedtrain.participant.local.checkpoint import write_json_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, {"participant_id": pid, "participant_key": key})
