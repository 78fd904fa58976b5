"""The template process behind `tests.helpers.zygote`: `python -m tests.helpers.zygote_server SOCKET`.

It imports torch and the `fedtrain` commands once, then forks a child for each request on the
Unix socket: the child takes the request's standard streams (passed as file descriptors), its
environment, working directory and argv, and runs `-m module` or a script as `__main__`, as a
fresh `python` would. The parent reaps it and answers the request with its exit status; a
request whose client goes away gets its child killed (a test process that died leaves nothing
running). The server is single-threaded, so a fork copies no half-held lock of ours, and it
ends when its parent (the test process, or the xdist controller that serves all its workers) does.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import json
import os
import random
import runpy
import select
import signal
import socket
import sys
import tempfile
import threading
import traceback
from typing import Any

PRELOAD = (
    "torch",
    "torch._dynamo",  # ~2 s: the first optimizer or `nn.init` call imports it (torch's `_disable_dynamo`)
    "torch.distributed.run",
    "fedtrain.cli.commands",
    "fedtrain.coordinator.http.main",
    "fedtrain.recipes.train",
    "uvicorn.protocols.http.auto",
    "uvicorn.protocols.websockets.auto",
    "uvicorn.lifespan.on",
    "uvicorn.loops.auto",
    "uvicorn.loops.uvloop",
    "anyio._backends._asyncio",
    # what children imported on their first call, counted over the FSDP, torchrun, e2e and restart tests:
    "httpcore._sync.http11",  # httpx's connections: the first request of every client
    "encodings.idna",
    "certifi",
    "safetensors.torch",
    "numpy.ctypeslib",
    "torch.profiler._cupti_monitor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "fedtrain.participant.local.dcp_checkpoint",
    "fedtrain.transport.direct",
    "fedtrain.transport.readinto",
)
"""What every child would import anyway (~5 s of CPU in a fresh process): imported once, here.
Nothing here runs a torch op: the template never starts OpenMP's threads, which a fork would
leave behind half-made. The participant's TLS context (the CAs its clients trust, ~0.25 s of
CPU, made once per process) is made here too."""
_THREADS = ("", 0)
"""The template's OMP_NUM_THREADS and torch's thread count from it, for a child whose differs."""


def _child(request: dict, fds: list[int], keep_closed: list[int]) -> None:
    """In the forked child: become the process the request describes, run it, and end."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as CPython sets it at start
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in keep_closed:
        with contextlib.suppress(OSError):
            os.close(fd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # read $TMPDIR afresh
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    for entry in reversed([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads != _THREADS[0] and "torch" in sys.modules:  # torch read it at import, in the template
        sys.modules["torch"].set_num_threads(int(threads) if threads.isdigit() else _THREADS[1])
    if request.get("nested"):
        _fork_python_children(request["nested"]["entry"], request["nested"]["env"])
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  encoding="utf-8", write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  encoding="utf-8", errors="backslashreplace", line_buffering=True,
                                  write_through=unbuffered)
    code = 0
    try:
        sys.argv = [request["target"], *request["args"]]
        if request["module"]:
            sys.modules.pop(request["target"], None)  # preloaded as a module: run afresh as __main__
            runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(request["target"])))
            runpy.run_path(request["target"], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        _end(130, interrupted=True)
    except BaseException:
        traceback.print_exc()
        code = 1
    _end(code)


def _fork_python_children(entry: str, added: dict[str, str]) -> None:
    """In a child asked to be `nested`: its `subprocess.Popen([sys.executable, -m ... | script.py
    ...])` runs `entry` (`zygote_exec.py`) in the interpreter's place, with `added` in the
    environment: the template forks those processes too."""
    import subprocess

    start = subprocess.Popen.__init__

    def __init__(self: subprocess.Popen, args: Any, *rest: Any, **kw: Any) -> None:
        argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else None
        if argv and not rest and not kw.get("shell") and argv[0] == sys.executable and len(argv) > 1:
            first = argv[2] if argv[1] == "-u" and len(argv) > 2 else argv[1]
            if first == "-m" or first.endswith(".py"):
                args = [entry, *argv[1:]]
                env = kw.get("env")
                kw["env"] = {**(os.environ if env is None else env), **added}
        start(self, args, *rest, **kw)

    subprocess.Popen.__init__ = __init__  # type: ignore[method-assign]


def _end(code: int, interrupted: bool = False) -> None:
    """The interpreter's exit, in its order: wait for threads, the exit handlers, flush; then end
    without the module teardown (the parent's modules are not ours to tear down)."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    if interrupted:  # as CPython ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def serve(path: str) -> None:
    global _THREADS
    for name in PRELOAD:
        importlib.import_module(name)
    from fedtrain.participant.client.answers import tls_context

    tls_context(True)
    _THREADS = (os.environ.get("OMP_NUM_THREADS", ""), sys.modules["torch"].get_num_threads())
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".binding")
    listener.listen(64)
    os.rename(path + ".binding", path)  # the socket appears listening: a client that waits for it may connect
    parent = os.getppid()
    print("ready", flush=True)
    children: dict[socket.socket, int] = {}  # a request's connection -> its child
    orphans: set[socket.socket] = set()  # connections whose client went away (their child is killed)
    while True:
        ready, _, _ = select.select([listener, wake_r, *(c for c in children if c not in orphans)], [], [], 1.0)
        if os.getppid() != parent:  # the test process is gone: so are its children
            for pid in children.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:  # reap, and tell each finished child's client its status
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            for conn, child in list(children.items()):
                if child == pid:
                    with contextlib.suppress(OSError):
                        conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                    conn.close()
                    del children[conn]
                    orphans.discard(conn)
        for conn in [c for c in ready if c in children]:  # a client went away before its child ended
            with contextlib.suppress(OSError):
                if conn.recv(16):
                    continue
            orphans.add(conn)
            with contextlib.suppress(ProcessLookupError):
                os.kill(children[conn], signal.SIGKILL)
        if listener in ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 8)
            request = json.loads(message)
            keep_closed = [listener.fileno(), wake_r, wake_w, conn.fileno(), *(c.fileno() for c in children)]
            pid = os.fork()
            if pid == 0:
                _child(request, fds, keep_closed)
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())
            children[conn] = pid


if __name__ == "__main__":
    serve(sys.argv[1])
