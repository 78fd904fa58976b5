"""Processes of the `fedtrain` command: a coordinator process on a free loopback port (started
once it answers, stopped, or killed by the test), a one-shot CLI call, a bounded wait; and the
tracking of the processes tests start (coordinators, torchrun groups): what a test left running
is killed after it (`reap`, from the autouse fixture in tests/conftest.py), with every process
under it, so that a test that failed half-way leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import psutil

from tests.helpers import zygote
from tests.helpers.config import PTOKEN

_started: list[subprocess.Popen] = []


def track(proc: subprocess.Popen) -> subprocess.Popen:
    """`proc`, recorded: `reap` kills it if a test leaves it running."""
    _started.append(proc)
    return proc


def started() -> int:
    """A mark for `reap`: the processes started so far."""
    return len(_started)


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill `proc` if it still runs, with every process under it (torchrun's ranks run in
    sessions of their own), and wait for them."""
    if proc.poll() is not None:
        return
    try:
        tree = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(tree, timeout=30)
    proc.communicate()


def reap(since: int = 0) -> None:
    """`kill_tree` every tracked process started after mark `since` (`started()`) that still runs."""
    left, _started[since:] = _started[since:], []
    for proc in left:
        kill_tree(proc)


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_coordinator(
    cfg_path: Path, state: Path, port: int, log: Path, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.Popen:
    """`python -m fedtrain coordinator` on 127.0.0.1:`port` over `state`, returned once it answers
    /v1/healthz (120 s at most: a loaded machine); its output is appended to `log`, shown if it fails to start.

    `args` are more command-line arguments, `env` more environment variables; the tokens are
    PTOKEN and "admin". Stop it with `stop_coordinator`, or kill it to test a crash.
    """
    env = {**os.environ, "FEDTRAIN_TOKEN": PTOKEN, "FEDTRAIN_ADMIN_TOKEN": "admin", **(env or {})}
    argv = [sys.executable, "-m", "fedtrain", "coordinator", "--config", str(cfg_path), "--state-dir", str(state)]
    with open(log, "ab") as out:  # the child holds its own copy of the file descriptor
        proc = track(zygote.popen([*argv, "--port", str(port), *args], env=env, stdout=out,
                                  stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 120
    with httpx.Client(timeout=1) as http:  # one client: each new one builds an SSL context (CPU, ~50 ms)
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if http.get(f"http://127.0.0.1:{port}/v1/healthz").status_code == 200:
                    return proc
            except httpx.TransportError:
                time.sleep(0.05)
    raise AssertionError("coordinator did not start: " + log.read_text()[-3000:])


def stop_coordinator(proc: subprocess.Popen) -> None:
    """Terminate a coordinator process if it still runs, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)


def wait_for(fn, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def fedtrain(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, "-m", "fedtrain", *args], text=True, timeout=timeout,
                      env={**os.environ, **(env or {})})


def assert_clean_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr
