"""One tiny training participant for the tests, on fedtrain's public API only.

A test that needs a participant training against a coordinator describes what it trains (a
task: `TinyGPT`, the built-in recipe at test size, or `Regression`, the `Small` module on a
fixed batch) and runs it in this thread or in a daemon thread of its own:

    p = train(c.url, "solo", Regression(rows=64))             # here, until the run finishes
    ps = [TinyParticipant(c.url, f"p{i}", TinyGPT(i, 3)).start() for i in range(3)]
    join_all(*ps)                                              # bounded; re-raises what one raised
    assert p.fed.round == 4 and p.losses[0] > p.losses[-1]

While a participant trains, its `fed` (the `Participant`: round, steps, history, outages, ...)
can be read from the test's thread; `joined` is set once it has joined. Every wait is bounded:
`join` fails when the thread still runs after its timeout, so no test hangs on a stuck run.
`TrainingThread` runs any other training function (the recipe's `run_participant`) the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from fedtrain import faults
from fedtrain.config import RunConfig
from fedtrain.participant import CoordinatorClient, OutagePolicy, Participant, RetryPolicy
from fedtrain.recipes import build_model
from fedtrain.recipes.data import TokenStream, evaluate, load_tokens, parse_data_spec
from fedtrain.wire import write_file
from tests.helpers.config import PTOKEN

JOIN_TIMEOUT_S = 240.0  # how long `join` waits for a training thread by default

Batch = tuple[torch.Tensor, torch.Tensor]

_GLOBAL_RNG = threading.Lock()
"""Held while a `Regression` seeds torch's global RNG and draws from it: that RNG is shared by
every thread, and without the lock two participants' tasks built at once would interleave
their draws, so that their weights and batches depended on the threads' timing."""


class Small(nn.Module):
    """Any nn.Module: two linear layers and a frozen parameter (which never travels)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(3, width)
        self.head = nn.Linear(width, 1)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.lin(x)))


def init_file(tmp_path: Path, model: nn.Module) -> Path:
    """`model`'s trainable weights as a coordinator's --init-weights file."""
    path = tmp_path / "init.safetensors"
    write_file(path, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad})
    return path


@dataclass
class Setup:
    """A task made concrete: the model, its inner optimizer, and one step's batch and loss."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Callable[[], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    tokens: Callable[[Batch], int]
    eval_fn: Callable[[nn.Module], float] | None = None


@dataclass(frozen=True)
class TinyGPT:
    """The built-in GPT of the run's model config, AdamW, on stdlib text shard `shard` of `of`.

    None takes the value from the run's config (asked of the coordinator before joining):
    batch_size, seq_len, lr. `model_seed` 0 is build_model's default; `data_seed` None is
    `shard`. With `eval_batches` > 0 the participant evaluates on that many held-out
    batches around its syncs (eval_fn)."""

    shard: int
    of: int
    model_seed: int = 0
    data_seed: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    eval_batches: int = 0

    def build(self, run: Callable[[], RunConfig]) -> Setup:
        cfg = run()
        model = build_model(cfg.model, seed=self.model_seed)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr if self.lr is None else self.lr)
        stream = TokenStream(
            load_tokens(parse_data_spec(f"stdlib:{self.shard}/{self.of}")),
            batch_size=cfg.train.batch_size if self.batch_size is None else self.batch_size,
            seq_len=cfg.train.seq_len if self.seq_len is None else self.seq_len,
            seed=self.shard if self.data_seed is None else self.data_seed,
        )
        held_out = list(stream.eval_batches(self.eval_batches)) if self.eval_batches else []

        def eval_fn(m: nn.Module) -> float:
            return evaluate(m, held_out)

        return Setup(model, opt, stream.next_batch, _gpt_loss, lambda b: b[0].numel(), eval_fn if held_out else None)


@dataclass(frozen=True)
class Regression:
    """`Small` (or `model`) trained by SGD on one fixed batch of `rows` random rows of 3.

    target "sum" fits y = x.sum(1) (MSE); "zero" minimises model(x)² (no labels). `seed`
    seeds torch's global RNG before the model and the batch are drawn (None: the caller's
    RNG state, in that order: model, then batch), under a lock that other `Regression`s
    building at once on other threads wait for."""

    rows: int = 16
    seed: int | None = None
    lr: float = 0.05
    target: Literal["sum", "zero"] = "sum"
    model: Callable[[], nn.Module] = Small

    def build(self, run: Callable[[], RunConfig] | None = None) -> Setup:
        with _GLOBAL_RNG:  # participants build their tasks on threads of their own, at once
            if self.seed is not None:
                torch.manual_seed(self.seed)
            model = self.model()
            opt = torch.optim.SGD(model.parameters(), lr=self.lr)
            return self.on(model, opt)

    def on(self, model: nn.Module, opt: torch.optim.Optimizer | None = None) -> Setup:
        """This task for a model the caller made (draws the batch now)."""
        x = torch.randn(self.rows, 3)
        y = x.sum(dim=1, keepdim=True)
        loss = _mse if self.target == "sum" else _square
        opt = opt if opt is not None else torch.optim.SGD(model.parameters(), lr=self.lr)
        return Setup(model, opt, lambda: (x, y), loss, lambda b: self.rows)


def _gpt_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    _, loss = model(*batch)
    return loss


def _mse(model: nn.Module, batch: Batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _square(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch[0]).pow(2).mean()


def inner_steps(
    fed: Participant,
    setup: Setup,
    *,
    steps: int | None = None,
    stop: threading.Event | None = None,
    step_sleep_s: float = 0.0,
    on_step: Callable[[Participant, float], None] | None = None,
    losses: list[float] | None = None,
) -> list[float]:
    """The user's loop: forward, backward, optimizer step, `fed.step(tokens, loss)`, until the
    run finishes (or `steps` steps, or `stop` is set). Returns the losses reported, appended
    to `losses` when given (so another thread sees them as they come)."""
    losses = [] if losses is None else losses
    done = 0
    while not fed.finished and (steps is None or done < steps) and not (stop is not None and stop.is_set()):
        done += 1
        batch = setup.batch()
        loss = setup.loss(setup.model, batch)
        loss.backward()
        setup.optimizer.step()
        setup.optimizer.zero_grad()
        losses.append(loss.item())
        fed.step(tokens=setup.tokens(batch), loss=losses[-1])
        if on_step is not None:
            on_step(fed, losses[-1])
        if step_sleep_s:
            time.sleep(step_sleep_s)
    return losses


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of `model`'s trainable weights (the ones that travel), by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class TrainingThread:
    """`target(*args, **kwargs)` in a daemon thread named `thread_name` (default: the `name`
    keyword argument, if any). `join` waits at most `timeout` seconds, fails if it still runs,
    re-raises what it raised, and returns what it returned."""

    def __init__(self, target: Callable[..., Any], *args: Any, thread_name: str | None = None, **kwargs: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        thread_name = thread_name or kwargs.get("name")
        self._thread = threading.Thread(target=self._run, args=(target, args, kwargs), name=thread_name, daemon=True)

    def _run(self, target: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            self.result = target(*args, **kwargs)
        except BaseException as e:
            self.error = e

    def start(self) -> TrainingThread:
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float = JOIN_TIMEOUT_S) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"{self._thread.name} still runs after {timeout:g} s"
        if self.error is not None:
            raise self.error
        return self.result


class TinyParticipant:
    """One participant training `task` against the coordinator at `url` as `name`.

    `run()` trains in the calling thread until the run finishes (or `steps`, or `stop`);
    `start()` does it in a daemon thread, and `join()` waits for it (see `TrainingThread`).
    The `Participant` is made from the URL with `token`, `retry`, `verify`, `outage`,
    `key_file` and `speed` (below 1: a slow site on purpose), and gets the task's optimizer
    as its inner optimizer. `on_join(fed)` runs right after the join (register callbacks
    there), `on_step(fed, loss)` after each `fed.step`. With `crashes`,
    an injected crash (`faults.InjectedCrash`) ends it quietly, like a killed process, and
    `crashed` says so; otherwise it is an error like any other.

    What it leaves, for the test to check: `fed` (set at join), `joined` (an Event, set once
    `joined_at` and `initial`, the weights it joined with, are recorded), `optimizer`,
    `model`, `losses` (every step's), `weights` (its trainable weights once the run finished),
    `error` (what its thread raised).
    """

    def __init__(
        self,
        url: str,
        name: str | None,
        task: TinyGPT | Regression,
        *,
        token: str = PTOKEN,
        retry: RetryPolicy = RetryPolicy(),
        verify: bool | str = True,
        outage: OutagePolicy = OutagePolicy(),
        key_file: Path | None = None,
        steps: int | None = None,
        stop: threading.Event | None = None,
        step_sleep_s: float = 0.0,
        on_join: Callable[[Participant], None] | None = None,
        on_step: Callable[[Participant, float], None] | None = None,
        crashes: bool = False,
        speed: float = 1.0,
    ) -> None:
        self.url, self.name, self.task, self.speed = url, name, task, speed
        self.token, self.retry, self.verify, self.outage, self.key_file = token, retry, verify, outage, key_file
        self.steps, self.stop, self.step_sleep_s = steps, stop, step_sleep_s
        self.on_join, self.on_step, self.crashes = on_join, on_step, crashes
        self.fed: Participant | None = None
        self.joined = threading.Event()
        self.joined_at: int | None = None
        self.initial: dict[str, torch.Tensor] = {}
        self.setup: Setup | None = None
        self.losses: list[float] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.crashed = False
        self._thread = TrainingThread(self.run, thread_name=name)

    @property
    def model(self) -> nn.Module:
        assert self.setup is not None, "not started"
        return self.setup.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        assert self.setup is not None, "not started"
        return self.setup.optimizer

    def loss(self) -> float:
        """The task's loss on its next batch (Regression: its one batch), without training."""
        assert self.setup is not None, "not started"
        with torch.no_grad():
            return self.setup.loss(self.setup.model, self.setup.batch()).item()

    def run(self) -> TinyParticipant:
        self.setup = setup = self.task.build(self._run_config)
        fed = Participant(self.url, token=self.token, retry=self.retry, verify=self.verify, model=setup.model,
                          inner_optimizer=setup.optimizer, eval_fn=setup.eval_fn, name=self.name,
                          outage=self.outage, key_file=self.key_file, speed=self.speed)
        try:
            with fed:
                self.fed = fed
                self.joined_at, self.initial = fed.round, trainable(setup.model)
                self.joined.set()
                if self.on_join is not None:
                    self.on_join(fed)
                inner_steps(fed, setup, steps=self.steps, stop=self.stop, step_sleep_s=self.step_sleep_s,
                            on_step=self.on_step, losses=self.losses)
            self.weights = trainable(setup.model)
        except faults.InjectedCrash:
            if not self.crashes:
                raise
            self.crashed = True
        return self

    def _run_config(self) -> RunConfig:
        """The run's config now, as the recipe reads it before joining."""
        with CoordinatorClient(self.url, self.token, retry=self.retry, verify=self.verify) as client:
            return RunConfig.model_validate(client.get_config()["config"])

    def start(self) -> TinyParticipant:
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        """What its thread raised, if it did (None while it trains)."""
        return self._thread.error

    def join(self, timeout: float = JOIN_TIMEOUT_S) -> TinyParticipant:
        self._thread.join(timeout)
        return self


def train(url: str, name: str | None, task: TinyGPT | Regression, **kw: Any) -> TinyParticipant:
    """`TinyParticipant(url, name, task, **kw).run()`: train here until the run finishes."""
    return TinyParticipant(url, name, task, **kw).run()


def join_all(*threads: TinyParticipant | TrainingThread, timeout: float = JOIN_TIMEOUT_S) -> None:
    """Wait for every thread (`timeout` seconds for all together), then fail with the first
    error any raised, or because one still runs."""
    deadline = time.monotonic() + timeout
    failures: list[BaseException] = []
    for t in threads:
        try:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        except BaseException as e:
            failures.append(e)
    if failures:
        raise failures[0]


def run_all(participants: Iterable[TinyParticipant], timeout: float = JOIN_TIMEOUT_S) -> list[TinyParticipant]:
    """Start them all, wait for them all (`join_all`); returns them."""
    started = [p.start() for p in participants]
    join_all(*started, timeout=timeout)
    return started
