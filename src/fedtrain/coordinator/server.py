"""Running the coordinator: in the foreground (the CLI) or on a background thread (tests, demo).

The listening socket is bound here, before uvicorn starts, so that port 0 picks a free
port with no race and the caller learns the real address at once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import socket
import threading
import time
from pathlib import Path

import uvicorn

from fedtrain.config import RunConfig
from fedtrain.coordinator import httpbody
from fedtrain.coordinator.app import create_app
from fedtrain.coordinator.auth import Tokens
from fedtrain.coordinator.httpbody import ReadIntoProtocol
from fedtrain.coordinator.limits import ServerLimits
from fedtrain.coordinator.service import Coordinator

log = logging.getLogger("fedtrain.coordinator")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def tune_allocator(threshold: int = 1 << 20, trim: int = 16 << 20) -> bool:
    """Send every freed block of `threshold` bytes or more straight back to the OS, and keep
    up to `trim` bytes of free memory at the top of the heap.

    glibc keeps freed large blocks in per-thread arenas and raises its mmap threshold after
    each free, so tensors read on the worker threads of concurrent uploads ratchet the
    coordinator's RSS up with the number of participants. A fixed threshold keeps the peak
    flat.

    Fixing it also fixes the trim threshold, at 128 KiB: the heap was then shrunk and grown
    again all through an upload, whose ~160 KiB body chunks are held a few MiB at a time
    until the spool writer is done with them, and every regrown page was faulted in and
    zeroed again. With `trim` kept, an upload is received as fast as by a server that drops
    the body. No effect outside glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim))
    except (OSError, AttributeError):
        return False


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def http_protocol() -> type[ReadIntoProtocol] | str:
    """Our protocol (bodies read in place, downloads by `sendfile`) where the installed
    uvicorn has what it relies on; uvicorn's own httptools protocol otherwise."""
    if httpbody.supported():
        return ReadIntoProtocol
    log.warning("this uvicorn's httptools protocol is not the one fedtrain's in-place body reads were built "
                "on: serving with the stock protocol (correct, but uploads and downloads are slower)")
    return "httptools"


def uvicorn_config(
    service: Coordinator,
    log_level: str = "warning",
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    limits: ServerLimits | None = None,
) -> uvicorn.Config:
    """How uvicorn serves the coordinator, held to `limits` (timeouts, connections; defaults if None)."""
    limits = limits or ServerLimits()
    protocol = http_protocol()
    ours = protocol is ReadIntoProtocol
    return uvicorn.Config(
        create_app(service),
        log_level=log_level,
        # A BufferedProtocol, which uvicorn only constructs: with our limits.
        http=functools.partial(ReadIntoProtocol, limits=limits) if ours else protocol,  # type: ignore[arg-type]
        loop="auto",
        access_log=False,
        timeout_keep_alive=math.ceil(limits.idle_timeout_s),
        # Ours answers over capacity itself (in the JSON error shape); the stock one has uvicorn's limit.
        limit_concurrency=None if ours else limits.max_connections,
        h11_max_incomplete_event_size=1 << 20,
        ssl_certfile=str(tls_cert) if tls_cert else None,
        ssl_keyfile=str(tls_key) if tls_key else None,
    )


class BackgroundCoordinator:
    """A coordinator serving on 127.0.0.1 from a thread; a context manager that stops it."""

    def __init__(
        self,
        state_dir: str | Path,
        config: RunConfig | None = None,
        *,
        tokens: Tokens | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        init_weights: Path | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        limits: ServerLimits | None = None,
        apply_config: bool = False,
    ) -> None:
        self.scheme = "https" if tls_cert else "http"
        self.service = Coordinator(
            state_dir, config, tokens or Tokens(["participant-token"], "admin-token"), init_weights=init_weights,
            apply_config=apply_config,
        )
        self.service.open()
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn_config(self.service, tls_cert=tls_cert, tls_key=tls_key, limits=limits))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def start(self) -> BackgroundCoordinator:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the coordinator did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        if self.service.lock is not None and not self.thread.is_alive():  # a lifespan that died before its stop
            self.service.lock.release()

    def __enter__(self) -> BackgroundCoordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
