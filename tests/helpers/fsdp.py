"""FSDP groups and their checks: the worker group and the CLI's `--parallel fsdp` group (both
through `tests.helpers.torchrun`), a group whose round-1 pieces fail for a while, each rank's
rows against the global model, and the numerics side: the single-process participant on the
same global batches, the inner step taken whole or in halves, one thread for exact sums."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from fedtrain import faults
from fedtrain.config import RunConfig
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import Participant
from fedtrain.recipes.build import build_model
from tests.helpers.config import PTOKEN
from tests.helpers.torchrun import participant_group, worker_group
from tests.helpers.workers.fsdp_numerics_worker import global_batch, inner_optimizer


def fsdp_group(url: str, name: str, out: Path, *extra: str, faults: str = "") -> subprocess.Popen:
    """A 2-rank FSDP participant (workers/fsdp_worker.py) under torchrun, writing its ranks' reports
    and final rows to `out`; `faults`: FEDTRAIN_FAULTS of its ranks."""
    return worker_group("fsdp_worker.py", url, name, str(out), *extra, env={"FEDTRAIN_FAULTS": faults})


def fsdp_cli_group(url: str, name: str, run_dir: Path, nproc: int = 2, env: dict[str, str] | None = None,
                   via: Literal["torchrun", "fedtrain"] = "torchrun") -> subprocess.Popen:
    """`torchrun` (or `fedtrain torchrun`) `--nproc_per_node N -m fedtrain participant --parallel fsdp ...`."""
    return participant_group(url, name, "--parallel", "fsdp", "--run-dir", str(run_dir), nproc=nproc, env=env,
                             via=via)


def shards_match(out: Path, final: dict[str, torch.Tensor]) -> None:
    """Each rank's rows of its final weights are the global model's rows."""
    for k in (0, 1):
        with safe_open(str(out / f"rank{k}.safetensors"), "pt") as f:
            rows = json.loads(f.metadata()["rows"])
            for n in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                start, stop = rows[n]
                assert torch.equal(f.get_tensor(n), final[n][start:stop]), (k, n)


def fail_round_one_pieces(c: BackgroundCoordinator, out: Path, hold_s: float) -> None:
    """Run an FSDP group "group" into `c` whose round 1 gets its first piece in, then has every
    other upload fail (500) for `hold_s` (a few failed attempts: each gives up after 1 s); the
    group must ride it out and finish."""
    with faults.inject("upload.streaming", "raise", who="group", round=1, after=1, times=0):
        group = fsdp_group(c.url, "group", out, "--attempt-s", "1", "--budget-s", "120")
        deadline = time.monotonic() + 120
        while not any(c.service.has_piece("group", 1, f"rank{k}") for k in (0, 1)):
            assert group.poll() is None and time.monotonic() < deadline, "round 1's first piece never came"
            time.sleep(0.05)
        time.sleep(hold_s)
    text, _ = group.communicate(timeout=240)
    assert group.returncode == 0, text[-3000:]


MODEL = {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32}


def inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, rows: int,
               cfg: RunConfig, halves: bool = False) -> int:
    """One step of `opt` on the mean loss of the next `rows` sequences of `gen` (`halves`: as two
    ranks take it, the mean of the two half-batch gradients); returns its tokens."""
    x, y = global_batch(gen, rows, cfg.train.seq_len, cfg.model.vocab_size)
    if not halves:
        _, loss = model(x, y)
        loss.backward()
    else:
        grads = []
        for part in (slice(0, rows // 2), slice(rows // 2, rows)):
            _, loss = model(x[part], y[part])
            loss.backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
            model.zero_grad(set_to_none=True)
        for n, p in model.named_parameters():
            p.grad = (grads[0][n] + grads[1][n]) / 2
    opt.step()
    opt.zero_grad(set_to_none=True)
    return x.numel()


def run_single(url: str, name: str, seed: int, rows: int, optimizer: str, cfg: RunConfig) -> None:
    """A single-process participant training on `rows` sequences per step, to the run's end."""
    model = build_model(cfg.model, seed=1)  # any weights: the global model is loaded at join
    opt = inner_optimizer(model, optimizer, cfg.train.lr)
    gen = torch.Generator().manual_seed(seed)
    with Participant(url, token=PTOKEN, model=model, inner_optimizer=opt, name=name) as fed:
        while not fed.finished:
            fed.step(tokens=inner_step(model, opt, gen, rows, fed.config))


def params(c: BackgroundCoordinator) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in c.service.inspect().weights.items()}


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread, as the ranks run (OMP_NUM_THREADS=1): the same kernels, the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def max_diff(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest |x − y| over every tensor, and the tensor it is in."""
    worst = max(x, key=lambda k: float((x[k] - y[k]).abs().max()))
    return float((x[worst] - y[worst]).abs().max()), worst
