"""Shared fixtures: tiny run configs, a coordinator on a free loopback port (in-process), a
coordinator as a `python -m fedtrain coordinator` process for tests that kill or signal it,
and `transport`, which runs a test once with the fast IO paths on and once with them off."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from fedtrain.config import RunConfig
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.transport import FAST_IO_ENV

PTOKEN = "participant-token"
ATOKEN = "admin-token"


def tiny_config(**overrides: object) -> RunConfig:
    data: dict = {
        "name": "test",
        "rounds": 3,
        "train": {"sync_every": 5, "seq_len": 32, "batch_size": 8, "eval_batches": 2, "lr": 3e-3},
        "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
        "heartbeat_interval_s": 0.5,
        "heartbeat_timeout_s": 20.0,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return RunConfig.model_validate(data)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[BackgroundCoordinator]:
    with BackgroundCoordinator(tmp_path / "state", tiny_config()) as c:
        yield c


@pytest.fixture(params=["fast", "plain"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test runs twice: with the fast IO paths on (`[fast]`) and off (`[plain]`: stock uvicorn,
    buffered checkpoints, plain httpx), through `FEDTRAIN_FAST_IO`, which coordinators and clients
    made in the test read, and `start_coordinator`'s processes inherit."""
    monkeypatch.setenv(FAST_IO_ENV, "1" if request.param == "fast" else "0")
    return str(request.param)


BOTH_TRANSPORTS = pytest.mark.usefixtures("transport")
"""`pytestmark = BOTH_TRANSPORTS`: every test of a module runs once per transport (`transport`)."""


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_coordinator(
    cfg_path: Path, state: Path, port: int, log: Path, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.Popen:
    """`python -m fedtrain coordinator` on 127.0.0.1:`port` over `state`, returned once it answers
    /v1/healthz (60 s at most); its output is appended to `log`, shown if it fails to start.

    `args` are more command-line arguments, `env` more environment variables; the tokens are
    PTOKEN and "admin". Stop it with `stop_coordinator`, or kill it to test a crash.
    """
    env = {**os.environ, "FEDTRAIN_TOKEN": PTOKEN, "FEDTRAIN_ADMIN_TOKEN": "admin", **(env or {})}
    argv = [sys.executable, "-m", "fedtrain", "coordinator", "--config", str(cfg_path), "--state-dir", str(state)]
    with open(log, "ab") as out:  # the child holds its own copy of the file descriptor
        proc = subprocess.Popen([*argv, "--port", str(port), *args], env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("coordinator did not start: " + log.read_text()[-3000:])


def stop_coordinator(proc: subprocess.Popen) -> None:
    """Terminate a coordinator process if it still runs, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)


def _fuzz_cases() -> dict[str, int]:
    """The API fuzzers' case counts in this process, by token (empty if test_fuzz did not run here)."""
    fuzz = sys.modules.get("tests.integration.test_fuzz")
    return dict(getattr(fuzz, "CASES", None) or {})


FUZZ_CASES = pytest.StashKey[dict[str, int]]()
"""The fuzzers' case counts the xdist workers reported to the controller, by token."""


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
        ran = ", ".join(f"{counts.get(token, 0)} with the {who} token"
                        for who, token in (("participant", PTOKEN), ("admin", ATOKEN)))
        terminalreporter.write_line(f"schemathesis ran {ran} (each case: no 5xx, or the test failed)")
