"""The participant's fast path: model downloads read from the socket straight into the
tensors, uploads sent from the tensors' memory (stdlib `http.client`).

httpx parses a response body through h11, which appends every received block to a
bytearray and slices it out again: two copies per byte on top of the socket read.
`http.client` hands `readinto` a buffer and, for large reads, fills it with one
`recv_into`, so the bytes go from the kernel into the parameter storage
`BodyReader.writable()` names, and nowhere else.

Uploads go the other way: httpx hands every chunk of a body to h11, which joins it into a
fresh `bytes` before the socket sees it. Here each chunk (a view of a tensor) goes to
`sendall` as it is.

A download broken on the way is resumed by the next attempt from where it stopped, its
`ModelBody` kept across attempts (`resume.py`), or fetched as parallel byte ranges
(`parallel.py`).

Only the download of the global model and the upload of an update take this path, only
with fast IO on (`FEDTRAIN_FAST_IO`), and only where httpx would have connected directly:
with fast IO off, or where a proxy in the environment applies (which httpx honours), both
go through httpx (the plain path). TLS uses the same trust as the httpx client
(certifi's CAs, or the CA file given, or none with `verify=False`). Errors come out as httpx's, so the
client's retry loop and error reporting treat both paths alike.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

import httpx

from fedtrain.errors import WireError
from fedtrain.transport.setting import fast_io_enabled

if TYPE_CHECKING:
    import torch

    from fedtrain.wire.format import TensorSpec

__all__ = ["VERSION_HEADER", "Direct", "ModelBody", "direct_request", "is_direct", "speaks_tls"]

VERSION_HEADER = "X-Fedtrain-Version"

# The most a single readinto asks for, so the hash thread receives the body in batches.
READ_BYTES = 1 << 20


def is_direct(url: str) -> bool:
    """Whether transfers to `url` take this path: fast IO is on, and httpx would connect to
    `url` without a proxy (environment settings)."""
    if not fast_io_enabled():
        return False
    parts = urlsplit(url)
    for _ in range(ENV_READS - 1):
        try:
            return _no_proxy(parts.scheme, parts.hostname or "")
        except (KeyError, RuntimeError):  # another thread changed os.environ while urllib walked it
            continue
    return _no_proxy(parts.scheme, parts.hostname or "")  # the last read: its error is the caller's


def _no_proxy(scheme: str, host: str) -> bool:
    """One read of the environment's proxies: whether `host` is reached without one."""
    proxies = urllib.request.getproxies()
    if not (proxies.get(scheme) or proxies.get("all")):
        return True
    return bool(urllib.request.proxy_bypass(host))


#: How many times `is_direct` reads the environment's proxies when another thread changes the
#: environment as it is read (urllib walks os.environ: a variable removed meanwhile is a KeyError;
#: a participant's upload thread once died of it while pytest set PYTEST_CURRENT_TEST).
ENV_READS = 5


def ssl_context(verify: bool | ssl.SSLContext) -> ssl.SSLContext:
    """The TLS settings of the httpx client, as a context for `http.client`."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    if verify:
        import certifi  # httpx's own dependency, and the CAs httpx trusts by default

        return ssl.create_default_context(cafile=certifi.where())
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


@dataclass
class Direct:
    """A response whose headers are read; its body is read with `readinto`."""

    status: int
    headers: httpx.Headers
    response: http.client.HTTPResponse

    def readinto(self, buffer: memoryview) -> int:
        """Fill the start of `buffer` (at most READ_BYTES); 0 at the end of the body."""
        with _as_read_error("download interrupted"):
            return self.response.readinto(buffer[:READ_BYTES])

    def read(self, n: int) -> bytes:
        with _as_read_error("download interrupted"):
            return self.response.read(n)

    def as_httpx(self) -> httpx.Response:
        """The whole (small) response as an httpx one, for the client's error reporting."""
        return httpx.Response(self.status, headers=self.headers, content=self.read(1 << 20))


@contextmanager
def _as_read_error(what: str) -> Iterator[None]:
    """Socket and protocol errors as httpx's, which the client's retry loop knows."""
    try:
        yield
    except (OSError, http.client.HTTPException) as e:
        raise httpx.ReadError(f"{what}: {e}") from e


@contextmanager
def direct_request(
    method: str,
    base_url: str,
    path: str,
    params: dict[str, Any],
    headers: dict[str, str],
    *,
    connect_timeout: float,
    read_timeout: float,
    tls: ssl.SSLContext,
    body: Iterable[memoryview] | None = None,
    write_timeout: float | None = None,
) -> Iterator[Direct]:
    """`method` `base_url + path` on a connection of its own, sending `body` (its chunks as
    they are; give its Content-Length in `headers`); yields once the response's headers are in."""
    parts = urlsplit(base_url)
    host, port = parts.hostname or "", parts.port
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=connect_timeout, context=tls)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=connect_timeout)
    target = parts.path.rstrip("/") + path + (f"?{urlencode(params)}" if params else "")
    try:
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as e:
            raise httpx.ConnectError(f"cannot connect to {base_url}: {e}") from e
        assert conn.sock is not None
        # A body is sent whole whatever the answer, so no "Connection: close" with one: a server
        # that answers before reading it (e.g. 401) then reads the rest and drops it, instead of
        # closing on a client still sending (which would see a reset, not the answer).
        fields = {**headers, "Accept-Encoding": "identity"}
        if body is None:
            fields["Connection"] = "close"
        else:
            try:
                conn.sock.settimeout(read_timeout if write_timeout is None else write_timeout)
                conn.putrequest(method, target, skip_accept_encoding=True)
                for name, value in fields.items():
                    conn.putheader(name, value)
                conn.endheaders()
                for chunk in body:
                    conn.sock.sendall(chunk)
            except (OSError, http.client.HTTPException) as e:
                raise httpx.WriteError(f"sending to {base_url} failed: {e}") from e
        with _as_read_error(f"no answer from {base_url}"):
            conn.sock.settimeout(read_timeout)  # between two bytes, as httpx's read timeout
            if body is None:
                conn.request(method, target, headers=fields)
            response = conn.getresponse()
        yield Direct(response.status, httpx.Headers(response.getheaders()), response)
    finally:
        conn.close()


def speaks_tls(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TLS handshake completes at host:port (no certificate check: this only asks
    whether the port wants TLS, it trusts nothing it learns)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except (OSError, ssl.SSLError):
        return False


class ModelBody:
    """What both download paths share: parse the body into place, hash it on a worker
    thread (overlapping with the network and the copies), check length and digest before
    anything is returned. A context manager: the hash thread ends with it."""

    def __init__(self, headers: httpx.Headers, allocate: Callable[[TensorSpec], torch.Tensor] | None,
                 on_header: Callable[[dict[str, TensorSpec], dict[str, str]], None] | None,
                 progress: Callable[[int], None] | None = None) -> None:
        # torch comes in with the first download, not with the client
        from fedtrain.wire.digest import DIGEST_HEADER, BackgroundDigest, parse_digest
        from fedtrain.wire.reader import BodyReader

        self.length = int(headers["content-length"]) if "content-length" in headers else None
        self.expected = headers.get(DIGEST_HEADER)
        self.version = int(headers.get(VERSION_HEADER, -1))
        self.reader = BodyReader(expected_length=self.length, allocate=allocate, on_header=on_header)
        self.hasher = BackgroundDigest(parse_digest(self.expected)[0]) if self.expected is not None else None
        self.out: dict[str, torch.Tensor] = {}
        self._progress = progress

    @property
    def received(self) -> int:
        """Bytes of the body in place so far (a resumed download asks for the rest: `resume.py`)."""
        return self.reader.bytes_received

    @property
    def resumable(self) -> bool:
        """Whether the rest of this body may still come (a resumed download): it is cut short,
        refused nothing, and its running digest is still open."""
        return self.reader.truncated() is not None and (self.hasher is not None or self.expected is None)

    def feed(self, chunk: bytes) -> None:
        self.out.update(self.reader.feed(chunk))
        if self.hasher is not None:
            self.hasher.update(chunk)
        if self._progress is not None:
            self._progress(len(chunk))

    def wrote(self, region: memoryview, n: int) -> None:
        """`n` bytes were read into the start of `reader.writable()`, i.e. `region`."""
        if self.hasher is not None:
            self.hasher.update(region[:n])  # the tensor's own memory: written once, never again
        self.out.update(self.reader.wrote(n))
        if self._progress is not None:
            self._progress(n)

    def read_into(self, response: Direct) -> None:
        """A direct response's body (all of it, or the rest of it: a resumed download), read
        straight into the tensors' storage, until it ends; `finish` then checks it."""
        reader = self.reader
        while not reader.done:
            region = reader.writable()
            if region is None:  # the prefix and the header: read exactly those
                chunk = response.read(reader.head_needed)
                if not chunk:
                    break
                self.feed(chunk)
                continue
            n = response.readinto(region)
            if not n:
                break
            self.wrote(region, n)

    def finish(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The body's tensors once it is whole and its digest checks. A body cut short raises
        `WireError` (which the retry loop retries) and stays as it is, to be resumed; a digest
        that does not match raises `WireError` too, and the body is no longer `resumable`."""
        from fedtrain.wire.digest import verify_digest

        cut = self.reader.truncated()
        if cut is not None:
            raise WireError(cut)
        self.reader.finish()
        if self.length is not None and self.reader.bytes_received != self.length:
            raise WireError(f"the model body is {self.reader.bytes_received} bytes, its Content-Length {self.length}")
        if self.hasher is not None and self.expected is not None:
            got, self.hasher = self.hasher.digest(), None
            verify_digest(got, self.expected)
        return self.version, self.out

    def __enter__(self) -> ModelBody:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.hasher is not None:
            self.hasher.close()
