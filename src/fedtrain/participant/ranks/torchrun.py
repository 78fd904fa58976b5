"""Running a participant under torchrun: joining the job's process group, and torchrun itself in our
process (`fedtrain torchrun`), ending as a `fedtrain` command does.

Stopping: a SIGTERM (or Ctrl+C) reaches every rank, which stops like any `fedtrain` command:
"fedtrain participant: stopped", status 130, no traceback. torchrun's own launcher then prints
torch's `SignalException` traceback, in its process, which no code of ours runs in; `launch` runs
that launcher in our process and ends it with one line instead. The ranks of one participant
share its sync through `Participant` (`roles.py`, `group.py`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fedtrain.errors import FedtrainError

__all__ = ["init_from_env", "launch", "world_from_env"]

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
