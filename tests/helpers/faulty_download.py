"""A TCP proxy on loopback that breaks downloads on purpose: the Nth connection through it is
cut, silenced or corrupted after a chosen number of response bytes; the others pass. It counts
the bytes it carries back to the client, so a test sees what a resumed download fetched again."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Fault:
    """What happens to one connection's response once `after` bytes of it have passed: "cut"
    (both ends closed), "silent" (nothing more passes for `silent_s`, then closed), or "flip"
    (the byte at `after` is altered, the rest passes). `before`: called just before."""

    kind: str
    after: int
    silent_s: float = 5.0
    before: Callable[[], None] | None = None


class FaultyLink:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`target`; connection i follows `faults[i]` if any."""

    def __init__(self, target: int, faults: list[Fault | None]) -> None:
        self.target, self.faults = target, list(faults)
        self.down = 0  # response bytes carried to clients, all connections
        self.connections = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept)

    def _spawn(self, fn: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        self._server.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                i, self.connections = self.connections, self.connections + 1
            fault = self.faults[i] if i < len(self.faults) else None
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._spawn(self._pump, client, upstream, None, False)
            self._spawn(self._pump, upstream, client, fault, True)

    def _pump(self, src: socket.socket, dst: socket.socket, fault: Fault | None, down: bool) -> None:
        passed = 0
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if fault is not None and passed + len(data) > fault.after:
                    keep = fault.after - passed
                    if fault.before is not None:
                        fault.before()
                    if fault.kind == "flip":
                        data = data[:keep] + bytes([data[keep] ^ 0xFF]) + data[keep + 1:]
                        fault = None
                    else:
                        self._send(dst, data[:keep], down)
                        if fault.kind == "silent":
                            self._stop.wait(fault.silent_s)
                        break
                self._send(dst, data, down)
                passed += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def _send(self, dst: socket.socket, data: bytes, down: bool) -> None:
        dst.sendall(data)
        if down:
            with self._lock:
                self.down += len(data)

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> FaultyLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
