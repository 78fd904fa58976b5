"""A participant's processes, as its join describes them: how it trains in parallel, on how many ranks.

A participant is one process or a torchrun group: DDP (`participant/distributed.py`: rank 0
speaks for the group) or FSDP (`participant/fsdp.py`: every rank uploads its own shard as a
piece of the update). Its join's `info` says which: `parallel` ("ddp" or "fsdp"; absent: one
process) and `world_size` (the group's ranks). The status, `fedtrain status`, the dashboard
and `/metrics` show both.

More: docs/architecture.md, "coordinator/members/processes.py".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedtrain.errors import Refused

SINGLE, DDP, FSDP = "single", "ddp", "fsdp"
PARALLEL = (SINGLE, DDP, FSDP)
#: The most ranks a participant may say it has: far past any torchrun job, small enough to show.
MAX_WORLD_SIZE = 1 << 20


def _world_size(value: Any) -> int | None:
    """`value` as a world size, or None if it is not one (bool is not a count)."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_WORLD_SIZE:
        return value
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_info(info: Mapping[str, Any]) -> None:
    """Refuse (400 `invalid_info`) a join whose `parallel` or `world_size` is malformed; a
    field left out (or null) is fine: no `parallel` is one process, no `world_size` unknown."""
    parallel, world = info.get("parallel"), info.get("world_size")
    if parallel is not None and (not isinstance(parallel, str) or parallel not in PARALLEL):
        raise Refused(400, "invalid_info", f"info.parallel must be one of {', '.join(map(repr, PARALLEL))} (how the "
                      f"participant's processes train), got {_shown(parallel)}", {"field": "info.parallel"})
    if world is not None and _world_size(world) is None:
        raise Refused(400, "invalid_info", f"info.world_size must be a whole number of ranks from 1 to "
                      f"{MAX_WORLD_SIZE}, got {_shown(world)}", {"field": "info.world_size"})
    if parallel == SINGLE and world is not None and world > 1:
        raise Refused(400, "invalid_info", f"info.parallel 'single' is one process, but info.world_size is {world}: "
                      "say 'ddp' or 'fsdp' for a torchrun group", {"field": "info.parallel"})


def describe(info: Mapping[str, Any]) -> tuple[str | None, int | None]:
    """(parallel, world_size) of a stored info, for the status: "single" with 1 for one
    process; "ddp" or "fsdp" with the ranks (None when not said); None for what cannot be
    read: a malformed value, or several ranks without a word on how they train."""
    if not isinstance(info, Mapping):
        return None, None
    parallel, world = info.get("parallel"), _world_size(info.get("world_size"))
    if parallel is None:
        return (SINGLE, 1) if world in (None, 1) else (None, world)
    if not isinstance(parallel, str) or parallel not in PARALLEL:
        return None, world
    if parallel == SINGLE:
        return (SINGLE, 1) if world in (None, 1) else (None, world)
    return parallel, world
