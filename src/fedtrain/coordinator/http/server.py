"""Running the coordinator: in the foreground (the CLI) or on a background thread (tests, demo).

The listening socket is bound here, before uvicorn starts, so that port 0 picks a free
port with no race and the caller learns the real address at once.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from pathlib import Path

import uvicorn

from fedtrain.config import RunConfig
from fedtrain.coordinator.http.app import create_app
from fedtrain.coordinator.members.auth import Tokens
from fedtrain.coordinator.service import Coordinator
from fedtrain.transport.http_server import fast_protocol, stock_protocol
from fedtrain.transport.server_limits import ServerLimits
from fedtrain.transport.setting import fast_io_enabled


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class CoordinatorServer(uvicorn.Server):
    """uvicorn's server, with one step before it waits for the requests in flight at a stop:
    the coordinator's long polls and event streams are told to answer now, so a stop (Ctrl-C,
    SIGTERM) takes as long as the uploads in flight, not as long as a participant's `wait`."""

    def __init__(self, config: uvicorn.Config, service: Coordinator) -> None:
        super().__init__(config)
        self.service = service

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.service.stop_waiting()
        await super().shutdown(sockets)


def uvicorn_config(
    service: Coordinator,
    log_level: str = "warning",
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    limits: ServerLimits | None = None,
    fast_io: bool | None = None,
) -> uvicorn.Config:
    """How uvicorn serves the coordinator, held to `limits` (timeouts, connections; defaults if
    None): with the fast protocol when fast IO is on (`fast_io`, else `FEDTRAIN_FAST_IO`) and
    uvicorn is in its tested range, else with uvicorn's stock httptools protocol."""
    limits = limits or ServerLimits()
    ours = fast_protocol(limits, fast_io)
    return uvicorn.Config(
        create_app(service),
        log_level=log_level,
        http=ours or stock_protocol(limits),  # type: ignore[arg-type]  # a protocol factory; uvicorn only calls it
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
    """A coordinator serving on 127.0.0.1 from a thread; a context manager that stops it.
    `fast_io` switches the fast IO paths on or off for this coordinator (None: `FEDTRAIN_FAST_IO`
    decides); `fast_io` tells which it got. `stop` lets requests in flight finish for up to
    `graceful_shutdown_s` (None: however long they take), then cancels them: a participant's
    long poll of its round would otherwise hold the stop for up to its `wait` (60 s at most)."""

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
        fast_io: bool | None = None,
        graceful_shutdown_s: int | None = 2,
    ) -> None:
        self.scheme = "https" if tls_cert else "http"
        self.fast_io = fast_io_enabled(fast_io)
        self.service = Coordinator(
            state_dir, config, tokens or Tokens(["participant-token"], "admin-token"), init_weights=init_weights,
            apply_config=apply_config, fast_io=self.fast_io,
        )
        self.service.open()
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = CoordinatorServer(uvicorn_config(self.service, tls_cert=tls_cert, tls_key=tls_key,
                                                       limits=limits, fast_io=self.fast_io), self.service)
        self.server.config.timeout_graceful_shutdown = graceful_shutdown_s
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
