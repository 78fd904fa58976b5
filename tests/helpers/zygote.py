"""Processes of `python -m fedtrain ...` (and of `python -m torch.distributed.run`) forked from a
template that already imported torch, instead of started cold.

A fresh process spends ~3 s of CPU importing torch and our commands before it does anything;
most of the processes the tests start do little more than that (a coordinator that serves a few
rounds of a tiny model), and on two cores that CPU is the default run's time. `popen(argv, ...)`
takes the arguments of `subprocess.Popen` and, where `argv` is `sys.executable [-u] -m module
...` or `sys.executable [-u] script ...`, asks the template (`tests/helpers/zygote_server.py`)
to fork the process; anything else goes to `subprocess.Popen`. Under xdist one template serves
all the workers (the controller starts it: `start_shared`); otherwise a test process starts its
own on first use. The process is real and separate: its own pid, environment, working
directory, standard streams, signals and exit status; only the interpreter's start is shared.
`Forked` answers the `Popen` methods the tests use. A torchrun group's ranks are forked too:
`rank_launch` runs them through `zygote_exec.py` (`torchrun --no-python`), which passes
torchrun's signals on and ends with the rank's status.

`popen(..., nested=True)` forks the process's own Python children too (the demo's coordinator
and participants). Tests of the cold start itself (what a command imports, how long it takes to
print, the short demo as a user first runs it) keep `subprocess.Popen`. `FEDTRAIN_TEST_ZYGOTE=0`
turns the template off for a whole run.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
ENV = "FEDTRAIN_TEST_ZYGOTE"
SOCKET_ENV = "FEDTRAIN_TEST_ZYGOTE_SOCKET"
STARTUP_ENV = "FEDTRAIN_TEST_ZYGOTE_STARTUP"
SHARED_ENV = "FEDTRAIN_TEST_ZYGOTE_SHARED"
"""The socket of a template that pytest-xdist's controller started for all its workers (`start_shared`)."""
SHARED_WAIT_S = 120.0

_lock = threading.Lock()
_server: tuple[subprocess.Popen | None, str] | None = None  # (None: the controller's shared one, path)


def _spawn() -> tuple[subprocess.Popen, str, dict[str, str]]:
    """A template process (it listens once it has imported what it preloads), its socket, its environment."""
    path = os.path.join(tempfile.mkdtemp(prefix="fedtrain-zygote-"), "sock")
    path_entries = (str(ROOT), os.environ.get("PYTHONPATH", ""))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path_entries if p)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.zygote_server", path], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, cwd=ROOT)
    atexit.register(_stop, proc)
    return proc, path, env


def start_shared() -> None:
    """In pytest-xdist's controller, before it starts its workers: one template for all of them
    (one import of torch and our commands instead of one per worker). It is not waited for here:
    it imports while the workers start and collect. They inherit its socket (`SHARED_ENV`) and
    its start-up settings, and wait for the socket on first use (it appears once it listens)."""
    global _server
    proc, path, env = _spawn()
    _server = (proc, path)
    os.environ[SHARED_ENV] = path
    os.environ[STARTUP_ENV] = json.dumps(startup_env(env))


def _socket_path() -> str:
    """The template's socket: the controller's shared one, or this process's, started if it has none running."""
    global _server
    with _lock:
        if _server is not None and (_server[0] is None or _server[0].poll() is None):
            return _server[1]
        shared = os.environ.get(SHARED_ENV)
        if shared and _server is None:
            deadline = time.monotonic() + SHARED_WAIT_S
            while not os.path.exists(shared):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the shared test template did not listen on {shared} in {SHARED_WAIT_S:g} s")
                time.sleep(0.05)
            _template_env.clear()
            _template_env.update(_template_startup())
            _server = (None, shared)
            return shared
        proc, path, env = _spawn()
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != b"ready":
            proc.kill()
            raise RuntimeError(f"the zygote did not start: {line!r}")
        _server = (proc, path)
        _template_env.clear()
        _template_env.update(startup_env(env))
        return path


_entry: list[str] = []


def _exec_entry() -> tuple[str, dict[str, str]]:
    """An executable `zygote_exec.py` (it asks the template to fork `python ARGS` in its place)
    and the environment it needs (the template's socket and start-up settings)."""
    path = _socket_path()
    with _lock:
        if not _entry:  # one per process: the workers of a shared template write theirs beside its socket
            entry = os.path.join(os.path.dirname(path), f"rank-{os.getpid()}")
            source = (Path(__file__).with_name("zygote_exec.py")).read_text()
            Path(entry).write_text(f"#!{sys.executable}\n{source}")
            os.chmod(entry, 0o755)
            _entry.append(entry)
    return _entry[0], {SOCKET_ENV: path, STARTUP_ENV: json.dumps(_template_env)}


def rank_launch(env: Mapping[str, str] | None) -> tuple[list[str], dict[str, str]]:
    """For a torchrun group whose ranks the template forks: the launcher's arguments that go
    before the rank's argv (`--no-python ENTRY`, ENTRY an executable `zygote_exec.py`) and the
    ranks' added environment (the template's socket)."""
    entry, added = _exec_entry()
    return ["--no-python", entry], {**(env or {}), **added}


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        proc.kill()
        proc.wait(timeout=10)


def _split(argv: Sequence[str]) -> dict | None:
    """`python [-u] -m module args` or `python [-u] script args` as a request; None for anything else."""
    argv = [str(a) for a in argv]
    if not argv or argv[0] != sys.executable:
        return None
    rest, unbuffered = argv[1:], False
    if rest[:1] == ["-u"]:
        rest, unbuffered = rest[1:], True
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return {"module": True, "target": rest[1], "args": rest[2:], "unbuffered": unbuffered}
    if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
        return {"module": False, "target": rest[0], "args": rest[1:], "unbuffered": unbuffered}
    return None


EMULATED = ("PYTHONPATH", "PYTHONUNBUFFERED")
"""The interpreter's settings from the environment that a forked child takes on; any other
(PYTHONVERBOSE, PYTHONDEVMODE, ...) acts only at an interpreter's start."""


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env`'s settings that act only at an interpreter's start (see `EMULATED`)."""
    return {k: v for k, v in env.items() if k.startswith("PYTHON") and k not in EMULATED}


_template_env: dict[str, str] = {}


def _template_startup() -> dict[str, str]:
    """The start-up settings of this process's template: the one it uses, else the controller's
    shared one, else the one it would start (this process's own)."""
    if _server is not None:
        return _template_env
    if os.environ.get(SHARED_ENV):
        return dict(json.loads(os.environ.get(STARTUP_ENV, "{}")))
    return startup_env(os.environ)


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() != "0"


def popen(argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
          stdout: Any = None, stderr: Any = None, text: bool = False, nested: bool = False) -> Any:
    """`subprocess.Popen(argv, env=..., cwd=..., stdout=..., stderr=..., text=...)`, forked from the
    template where it can be (see the module). `nested`: the process's own `python -m ...` and
    `python script.py` children are forked from the template too (through `zygote_exec.py`, which
    passes their signals on and ends as they end), e.g. the demo's coordinator and participants.
    Not for a process that kills its children's process group (`killpg`): that reaches only
    `zygote_exec.py`, and the template kills the child a moment later, not at once."""
    request = _split(argv) if enabled() else None
    if request is not None and startup_env(os.environ if env is None else env) != _template_startup():
        request = None  # it asks for an interpreter started differently: start one
    if request is None:
        return subprocess.Popen(list(argv), env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text)
    if nested:
        entry, added = _exec_entry()
        request = {**request, "nested": {"entry": entry, "env": added}}
    return Forked(list(argv), request, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text)


def _fd(target: Any, default: int, close_after: list[int]) -> tuple[int, int | None]:
    """(the fd to send, our read end if a pipe)."""
    if target is None:
        return default, None
    if target == subprocess.PIPE:
        r, w = os.pipe()
        close_after.append(w)
        return w, r
    if target == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        close_after.append(fd)
        return fd, None
    return (target if isinstance(target, int) else target.fileno()), None


class Forked:
    """A process forked by the template: `subprocess.Popen`'s face (pid, returncode, stdout,
    poll, wait, communicate, send_signal, terminate, kill)."""

    def __init__(self, args: list[str], request: dict, *, env: Mapping[str, str] | None, cwd: Any,
                 stdout: Any, stderr: Any, text: bool) -> None:
        self.args, self.returncode = args, None
        self.stdin: IO | None = None
        close_after: list[int] = []
        null = os.open(os.devnull, os.O_RDONLY)
        close_after.append(null)
        out_fd, out_r = _fd(stdout, 1, close_after)
        if stderr == subprocess.STDOUT:
            err_fd, err_r = out_fd, None
        else:
            err_fd, err_r = _fd(stderr, 2, close_after)
        request = {**request, "env": dict(os.environ if env is None else env), "cwd": str(cwd or os.getcwd())}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.connect(_socket_path())
            socket.send_fds(self._sock, [json.dumps(request).encode()], [null, out_fd, err_fd])
        finally:
            for fd in close_after:
                os.close(fd)
        reply = json.loads(self._sock.recv(4096))
        self.pid: int = reply["pid"]
        mode = "r" if text else "rb"
        self.stdout: IO | None = open(out_r, mode) if out_r is not None else None
        self.stderr: IO | None = open(err_r, mode) if err_r is not None else None
        self._read: dict[str, Any] = {}
        self._waiting = threading.Lock()
        self._readers: list[threading.Thread] = []

    def _status(self, timeout: float | None) -> bool:
        """Whether it ended, waiting up to `timeout`; one thread at a time, as `Popen.wait`."""
        with self._waiting:
            return self._read_status(timeout)

    def _read_status(self, timeout: float | None) -> bool:
        if self.returncode is not None:
            return True
        readable, _, _ = select.select([self._sock], [], [], timeout)
        if not readable:
            return False
        message = self._sock.recv(4096)  # the template's answer once it reaped the child
        self._sock.close()
        self.returncode = json.loads(message)["returncode"] if message else -signal.SIGKILL
        return True

    def poll(self) -> int | None:
        if self._waiting.acquire(blocking=False):  # else another thread waits on it: still running, as Popen says
            try:
                self._read_status(0)
            finally:
                self._waiting.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if not self._readers:
            for name in ("stdout", "stderr"):
                stream = getattr(self, name)
                if stream is not None:
                    reader = threading.Thread(target=lambda n=name, s=stream: self._read.__setitem__(n, s.read()),
                                              daemon=True)
                    reader.start()
                    self._readers.append(reader)
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return self._read.get("stdout"), self._read.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def disown(self) -> None:
        """Close the connection to the template, as this process's death would: the template
        kills the child."""
        self._sock.close()

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def run(argv: Sequence[str], *, timeout: float | None = None, env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None, text: bool = False, nested: bool = False) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, ...)`, forked from the template where it can be
    (`nested` as `popen`'s)."""
    proc = popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text, nested=nested)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
