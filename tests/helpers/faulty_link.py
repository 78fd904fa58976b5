"""A faulty link for tests: a TCP proxy on 127.0.0.1 that forwards to a server and, at chosen
byte counts, cuts the connection, goes silent, or damages a byte; it counts the bytes it
forwards each way, so a test can say how much was sent again.

    with FaultyLink(c.host, c.port) as link:
        link.cut_after(3 << 20)                   # up: reset after 3 MiB more client -> server
        link.stall_after(5 << 20, down=True)      # down: the connection goes silent after 5 MiB
        link.corrupt_at(100)                      # up: flip the 100th byte from now
        client = CoordinatorClient(link.url, ...)
        ...
        link.bytes_up, link.bytes_down, link.faults_hit

"Up" is client -> server (an upload's body), "down" server -> client (a download's). Byte
counts are counted over every connection, from the moment the fault is armed; each fault
fires once, on the connection that carries its byte. A cut resets both sides (RST). A
stalled connection forwards nothing more either way until it is closed by the proxy
(`close`), as a link that died without a word does; with `for_s` the whole link is silent
that long: a connection made meanwhile goes nowhere (what it sends is neither forwarded nor
counted) and is reset when the link comes back; new connections go through again from then.

Faults by connection instead (a download's tests: the Nth connection's response):

    with FaultyLink(c.host, c.port, [None, Fault("cut", 5 << 20), Fault("flip", 500)]) as link:
        ...                                       # connection 0 passes, 1 is cut, 2 has a byte flipped
        link.down, link.connections

`Fault(kind, after, silent_s, before)`: once `after` bytes of that connection's response have
passed, "cut" ends it, "silent" forwards nothing more for `silent_s` then ends it, "flip" alters
the byte at `after`; `before` is called just before.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Kind = Literal["cut", "stall", "corrupt"]


@dataclass
class Fault:
    """What happens to one connection's response once `after` bytes of it have passed (see the module)."""

    kind: Literal["cut", "silent", "flip"]
    after: int
    silent_s: float = 5.0
    before: Callable[[], None] | None = None


@dataclass
class _Fault:
    kind: Kind
    down: bool
    at: int  # fires at this byte of its direction's count (counted from 0 over the link)
    for_s: float | None = None
    fired: bool = False


class FaultyLink:
    """A TCP proxy from `url` to `host:port` with faults at byte counts (see the module)."""

    CHUNK = 64 << 10

    def __init__(self, host: str, port: int, by_connection: list[Fault | None] | None = None) -> None:
        self.target = (host, port)
        self._by_connection = list(by_connection or [])
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.1)
        self.port = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections = 0
        self.faults_hit: list[str] = []
        self._faults: list[_Fault] = []
        self._silent_until = 0.0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, name="faulty-link", daemon=True)
        self._accept.start()

    @property
    def down(self) -> int:
        """Response bytes carried to clients (`bytes_down`; a test may set it back to 0)."""
        return self.bytes_down

    @down.setter
    def down(self, value: int) -> None:
        self.bytes_down = value

    # -- arming faults --------------------------------------------------------------------------

    def cut_after(self, nbytes: int, *, down: bool = False) -> None:
        """Reset the connection that carries byte `nbytes` (from now) of that direction, before it."""
        self._arm(_Fault("cut", down, nbytes))

    def stall_after(self, nbytes: int, *, down: bool = False, for_s: float | None = None) -> None:
        """The connection that carries byte `nbytes` (from now) goes silent before it, for good;
        with `for_s`, new connections are held that long too (the link is down)."""
        self._arm(_Fault("stall", down, nbytes, for_s))

    def corrupt_at(self, nbytes: int, *, down: bool = False) -> None:
        """Flip the bits of byte `nbytes` (from now) of that direction."""
        self._arm(_Fault("corrupt", down, nbytes))

    def _arm(self, fault: _Fault) -> None:
        with self._lock:
            fault.at += self.bytes_down if fault.down else self.bytes_up
            self._faults.append(fault)

    # -- the proxy ------------------------------------------------------------------------------

    def close(self) -> None:
        self._closed.set()
        self._accept.join(5)
        for t in list(self._threads):
            t.join(5)
        self._server.close()

    def __enter__(self) -> FaultyLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(client,), name="faulty-link-conn", daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, client: socket.socket) -> None:
        if time.monotonic() < self._silent_until:
            # the link is down: a connection made now goes nowhere (nothing it sends is
            # forwarded or counted) and is reset when the link comes back
            while time.monotonic() < self._silent_until and not self._closed.is_set():
                time.sleep(0.02)
            _reset(client)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            _reset(client)
            return
        with self._lock:
            index, self.connections = self.connections, self.connections + 1
        mine = self._by_connection[index] if index < len(self._by_connection) else None
        passed = 0  # of this connection's response
        ends = {client: (upstream, False), upstream: (client, True)}  # socket -> (its peer, carries "down")
        try:
            while not self._closed.is_set():
                readable, _, _ = select.select(list(ends), [], [], 0.05)
                for sock in readable:
                    peer, down = ends[sock]
                    data = sock.recv(self.CHUNK)
                    if not data:
                        return
                    if down and mine is not None and passed + len(data) > mine.after:
                        keep, passed = mine.after - passed, passed + len(data)
                        if mine.before is not None:
                            mine.before()
                        if mine.kind == "flip":
                            data, mine = data[:keep] + bytes([data[keep] ^ 0xFF]) + data[keep + 1:], None
                        else:
                            _, head = self._through(data[:keep], down)
                            peer.sendall(head)
                            if mine.kind == "silent":
                                self._closed.wait(mine.silent_s)
                            return
                    elif down:
                        passed += len(data)
                    fault, data = self._through(data, down)
                    if data:
                        peer.sendall(data)
                    if fault is not None and fault.kind == "cut":
                        _reset(client)
                        _reset(upstream)
                        return
                    if fault is not None and fault.kind == "stall":
                        self._closed.wait()  # silent until the proxy closes
                        return
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def _through(self, data: bytes, down: bool) -> tuple[_Fault | None, bytes]:
        """What of `data` goes through (counted), and the fault it meets, if any."""
        with self._lock:
            start = self.bytes_down if down else self.bytes_up
            end = start + len(data)
            hit = next((f for f in sorted(self._faults, key=lambda f: f.at)
                        if not f.fired and f.down == down and start <= f.at < end), None)
            if hit is not None:
                hit.fired = True
                self.faults_hit.append(f"{hit.kind} {'down' if down else 'up'} at {hit.at}")
                cut = hit.at - start
                if hit.kind == "corrupt":
                    data = data[:cut] + bytes([data[cut] ^ 0xFF]) + data[cut + 1 :]
                else:
                    data = data[:cut]
                    if hit.kind == "stall" and hit.for_s is not None:
                        self._silent_until = time.monotonic() + hit.for_s
            if down:
                self.bytes_down += len(data)
            else:
                self.bytes_up += len(data)
            return (hit if hit is not None and hit.kind != "corrupt" else None), data


def _reset(sock: socket.socket) -> None:
    """Close with a reset (RST), as a link that breaks does, not a clean FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
