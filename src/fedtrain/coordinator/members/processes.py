"""A participant's processes, as its join describes them: how it trains in parallel, on how many ranks.

A participant is one process or a torchrun group: DDP (`participant/distributed.py`: rank 0
speaks for the group) or FSDP (`participant/fsdp.py`: every rank uploads its own shard as a
piece of the update). Its join's `info` says which: `parallel` ("ddp" or "fsdp"; absent: one
process) and `world_size` (the group's ranks). The status, `fedtrain status`, the dashboard
and `/metrics` show both.

More: docs/architecture.md, "coordinator/members/processes.py".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fedtrain.errors import Refused

SINGLE, DDP, FSDP = "single", "ddp", "fsdp"
PARALLEL = (SINGLE, DDP, FSDP)
#: The most ranks a participant may say it has: far past any torchrun job, small enough to show.
MAX_WORLD_SIZE = 1 << 20
#: A join's `info`, as compact JSON, at most: a few hundred facts; kept for as long as its row.
MAX_INFO_BYTES = 16 << 10
#: The most keys at its top level, and how deep its objects and lists may nest.
MAX_INFO_KEYS = 64
MAX_INFO_DEPTH = 8
#: What a departed participant's row keeps of its info: what the status shows and the joins check.
KEPT_AFTER_LEAVING = ("parallel", "world_size", "base")


def _world_size(value: Any) -> int | None:
    """`value` as a world size, or None if it is not one (bool is not a count)."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_WORLD_SIZE:
        return value
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_info(info: Mapping[str, Any]) -> None:
    """Refuse a join whose `info` is larger than its bounds (413 `info_too_large`: more than
    MAX_INFO_BYTES as JSON or MAX_INFO_KEYS keys; 400 `invalid_info`: nested deeper than
    MAX_INFO_DEPTH), or whose `parallel` or `world_size` is malformed (400 `invalid_info`); a
    field left out (or null) is fine: no `parallel` is one process, no `world_size` unknown."""
    if len(info) > MAX_INFO_KEYS:
        raise Refused(413, "info_too_large", f"info has {len(info)} keys, more than {MAX_INFO_KEYS}: say what the "
                      "run needs of the participant (host, parallel, world_size, ...)", {"field": "info"})
    if _depth(info) > MAX_INFO_DEPTH:
        raise Refused(400, "invalid_info", f"info nests objects or lists more than {MAX_INFO_DEPTH} deep",
                      {"field": "info"})
    size = len(json.dumps(info, separators=(",", ":")))
    if size > MAX_INFO_BYTES:
        raise Refused(413, "info_too_large", f"info is {size:,} bytes as JSON, more than the limit of "
                      f"{MAX_INFO_BYTES:,}: it is kept for as long as the participant's row", {"field": "info"})
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


def _depth(value: Any) -> int:
    """How deep `value` nests objects and lists (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if level > MAX_INFO_DEPTH:
            break  # deep enough to refuse: the rest need not be walked
        todo.extend((child, level + 1) for child in children)
    return deepest


def kept_after_leaving(info: Mapping[str, Any]) -> dict[str, Any]:
    """What a departed participant's row keeps of its `info` (`KEPT_AFTER_LEAVING`)."""
    return {k: info[k] for k in KEPT_AFTER_LEAVING if k in info}


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
