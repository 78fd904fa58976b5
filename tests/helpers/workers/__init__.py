"""Scripts that torchrun runs on every rank of a test's group (see `tests.helpers.torchrun`);
`end_at_once`, with which each ends once its work is written."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import Any, NoReturn


def end_at_once(code: int = 0) -> NoReturn:
    """End this rank's process now that its work is written, as the `fedtrain` command does
    (`fedtrain.cli.commands.run`): the exit handlers run and the output is flushed, but not the
    interpreter's teardown of torch's modules, which costs each rank ~3 s of a loaded machine's
    CPU (torchrun, and the test, wait for the slowest rank's)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def train_step(model: Any, opt: Any, data: Any) -> tuple[int, float]:
    """One inner step of the built-in GPT on the next batch of `data` (a `TokenStream`): its
    tokens and loss."""
    x, y = data.next_batch()
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return x.numel(), float(loss)
