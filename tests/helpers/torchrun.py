"""torchrun groups for the tests: the one launcher of every test that starts ranks (gloo, CPU).

`launch(*argv)` runs `python -m torch.distributed.run --standalone --nproc_per_node N ... argv`
(`via="fedtrain"`: `python -m fedtrain torchrun ...`, the command a user runs):

- rendezvous: `--standalone` (c10d on localhost:0, a new run id), so groups of tests running at
  once (xdist workers) never share a port or a rendezvous;
- environment: the test's own, the participant token, one OpenMP thread per rank (two ranks on
  two shared cores), and the repository root on PYTHONPATH so that worker scripts
  (`tests/helpers/workers/`) import `tests.helpers`;
- output: the ranks' and the launcher's stdout and stderr in one text pipe (`communicate`);
- cleanup: every process started here is tracked (`tests.helpers.processes.track`): what a test
  left running is killed after it, ranks included (`kill_tree`), so that a test that failed
  half-way leaves no rank training on.

`participant_group` and `worker_group` are the two kinds of group the tests start: the CLI's
`fedtrain participant` on every rank, or a worker script of `tests/helpers/workers/`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch

from fedtrain.wire import iter_file, read_tensors
from tests.helpers import zygote
from tests.helpers.config import PTOKEN
from tests.helpers.processes import track

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).with_name("workers")
GROUP_TIMEOUT_S = 240.0
"""How long a group may take to finish a test's run (a few rounds of a tiny model) on a loaded machine."""

def rank_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a group (or a single-process participant): see the module."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "FEDTRAIN_TOKEN": PTOKEN, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}


def _popen(argv: Sequence[str], env: Mapping[str, str] | None) -> subprocess.Popen:
    return track(zygote.popen(list(argv), env=rank_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True))


def launch(*argv: str, nproc: int = 2, via: Literal["torchrun", "fedtrain"] = "torchrun",
           launch_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """`argv` (a script and its arguments, or `-m module ...`) on `nproc` ranks; `launch_args`
    go to the launcher (e.g. `--log-dir`), `env` is added to the ranks' environment."""
    launcher = ["torch.distributed.run"] if via == "torchrun" else ["fedtrain", "torchrun"]
    entry: list[str] = []
    if zygote.enabled():  # the ranks are forked from the template too (`fedtrain torchrun` is torchrun's main)
        entry, env = zygote.rank_launch(env)
    return _popen([sys.executable, "-m", *launcher, "--standalone", "--nproc_per_node", str(nproc),
                   *launch_args, *entry, *argv], env)


def participant_group(url: str, name: str, *extra: str, data: str = "stdlib:0/2", **kw: object) -> subprocess.Popen:
    """`fedtrain participant --coordinator url --data data --name name *extra` on every rank of a
    group (`extra` may say `--parallel fsdp`); `kw` as `launch`'s."""
    argv = ["-m", "fedtrain", "participant", "--coordinator", url, "--data", data, "--name", name, *extra]
    return launch(*argv, **kw)  # type: ignore[arg-type]


def worker_group(script: str, *args: str, **kw: object) -> subprocess.Popen:
    """`tests/helpers/workers/<script>` with `args` on every rank of a group; `kw` as `launch`'s."""
    return launch(str(WORKERS / script), *args, **kw)  # type: ignore[arg-type]


def participant(url: str, name: str, *extra: str, data: str = "stdlib:1/2") -> subprocess.Popen:
    """A single-process `fedtrain participant` (no torchrun) beside a group, in the same environment."""
    argv = ["participant", "--coordinator", url, "--data", data, "--name", name, *extra]
    return _popen([sys.executable, "-m", "fedtrain", *argv], None)


def finished(proc: subprocess.Popen, timeout: float = GROUP_TIMEOUT_S) -> str:
    """Its output, once it ended with status 0 (its output's tail otherwise)."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def failed(proc: subprocess.Popen, timeout: float = GROUP_TIMEOUT_S) -> str:
    """Its output, once it ended with a status other than 0."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode != 0, out[-4000:]
    return out


def finish(group: subprocess.Popen, single: subprocess.Popen) -> str:
    """Both ended, with status 0 (their output's tail otherwise); the group's output."""
    out_group, _ = group.communicate(timeout=GROUP_TIMEOUT_S)
    out_single, _ = single.communicate(timeout=60)
    assert group.returncode == 0, out_group[-3000:]
    assert single.returncode == 0, out_single[-3000:]
    return out_group


def rank_summaries(out: str) -> list[dict]:
    """The JSON summaries the ranks printed at their end, in `out` (the group's output)."""
    decoder, found, at = json.JSONDecoder(), [], out.find('{"participant"')
    while at >= 0:  # the ranks share the pipe: a summary may follow another's output on the same line
        summary, end = decoder.raw_decode(out, at)
        found.append(summary)
        at = out.find('{"participant"', end)
    return found


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file a participant wrote (its final weights)."""
    return dict(read_tensors(iter_file(path)))
