"""Shared fixtures: a coordinator on a free loopback port (in-process), one with two participants
joined (`coord`), and `transport`, which runs a test once with the fast IO paths on and once with
them off; the xdist plumbing of the fuzzers' summary line. Shared helpers (tiny configs, a
coordinator process, torchrun groups, ...) live in `tests/helpers/`."""

from __future__ import annotations

import os
import sys

# torch on one thread in every test process and every process a test starts (they inherit it): four
# xdist workers share two cores, and torch's default (a thread per core, spinning while it waits)
# made each worker's tensor work compete with the other three; measured on test_quality's numerics
# under -n 4, 20-23 s a test with two threads, 7-8 s with one. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.transport import FAST_IO_ENV
from tests.helpers import bytecode, processes, zygote
from tests.helpers.api import client
from tests.helpers.config import tiny_config


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist's controller starts one test template for all its workers (`zygote.start_shared`),
    then writes the bytecode caches the workers read as they collect (`bytecode.warm`)."""
    workers = config.getoption("numprocesses", None)
    if getattr(config, "workerinput", None) is not None or workers in (None, 0, "0") \
            or config.getoption("collectonly"):
        return
    if zygote.enabled():
        zygote.start_shared()
    bytecode.warm(config)


@pytest.fixture(autouse=True)
def _no_process_left_running() -> Iterator[None]:
    """What a test started through `tests.helpers` (a coordinator process, a torchrun group) and
    left running (it failed half-way) is killed after it, torchrun's ranks included."""
    mark = processes.started()
    yield
    processes.reap(mark)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[BackgroundCoordinator]:
    with BackgroundCoordinator(tmp_path / "state", tiny_config()) as c:
        yield c


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[BackgroundCoordinator]:
    """A coordinator (uploads up to 1 MB) with participants "a" and "b" joined (the bad-input tests')."""
    with BackgroundCoordinator(tmp_path / "state", tiny_config(max_upload_mb=1.0)) as c:
        with client(c) as http:
            http.post("/v1/join", json={"name": "a"})
            http.post("/v1/join", json={"name": "b"})
        yield c


@pytest.fixture(params=["fast", "plain"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test runs twice: with the fast IO paths on (`[fast]`) and off (`[plain]`: stock uvicorn,
    buffered checkpoints, plain httpx), through `FEDTRAIN_FAST_IO`, which coordinators and clients
    made in the test read, and `start_coordinator`'s processes inherit."""
    monkeypatch.setenv(FAST_IO_ENV, "1" if request.param == "fast" else "0")
    return str(request.param)


SLOW_FIRST = (
    "fault/test_coordinator_crash.py", "integration/test_torchrun_sigterm.py", "fault/test_chaos.py",
    "integration/test_demo.py", "integration/test_fsdp_faults.py", "fault/test_participant_faults.py",
    "integration/test_torchrun.py", "integration/test_fsdp_streaming.py", "integration/test_fsdp_cli.py",
    "integration/test_restart.py", "integration/test_streaming.py", "integration/test_fsdp.py",
    "integration/test_state_lock.py", "integration/test_config_restart.py", "integration/test_run_totals.py",
    "integration/test_async.py", "integration/test_identity.py", "unit/test_hf_recipe.py",
)
"""Modules whose tests start processes (coordinators, torchrun groups, the demo) and take 10-50 s
each (`--durations`): collected first, so that xdist hands them out first and the short tests
fill in the gaps, rather than a long one starting last and running on alone."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    here = Path(__file__).parent

    def key(item: pytest.Item) -> int:
        return rank.get(item.path.relative_to(here).as_posix(), len(SLOW_FIRST))

    items.sort(key=key)  # stable: the order within a module, and of all the other modules, stays


def _fuzz_cases() -> dict[str, int]:
    """The API fuzzers' case counts in this process, by mode (empty if test_fuzz did not run here)."""
    fuzz = sys.modules.get("tests.integration.test_fuzz")
    return dict(getattr(fuzz, "CASES", None) or {})


FUZZ_CASES = pytest.StashKey[dict[str, int]]()
"""The fuzzers' case counts the xdist workers reported to the controller, by mode."""


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its fuzz case counts to the controller, which prints the summary."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and any(_fuzz_cases().values()):
        workeroutput["fuzz_cases"] = _fuzz_cases()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's controller: add up what each worker's fuzzers ran."""
    counts = getattr(node, "workeroutput", {}).get("fuzz_cases") or {}
    total = node.config.stash.setdefault(FUZZ_CASES, {})
    for token, n in counts.items():
        total[token] = total.get(token, 0) + n


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say how many cases the API fuzzers ran (a fuzz run of 0 cases must not read as a pass;
    `test_fuzz.py` also fails then), in the summary of every run that included them, in one
    process or under xdist (whose workers report their counts to the controller)."""
    counts = _fuzz_cases() or terminalreporter.config.stash.get(FUZZ_CASES, {})
    if counts and any(counts.values()):
        ran = ", ".join(f"{counts.get(mode, 0)} {mode}" for mode in ("positive", "negative", "stateful"))
        terminalreporter.write_line(f"schemathesis ran {ran} cases (positive and stateful: no 5xx; negative: a 4xx; "
                                    "or the test failed)")
