"""Model downloads read from the socket straight into the tensors, uploads sent from the
tensors' memory (stdlib `http.client`).

httpx parses a response body through h11, which appends every received block to a
bytearray and slices it out again: two copies per byte on top of the socket read.
`http.client` hands `readinto` a buffer and, for large reads, fills it with one
`recv_into`, so the bytes go from the kernel into the parameter storage
`BodyReader.writable()` names, and nowhere else.

Uploads go the other way: httpx hands every chunk of a body to h11, which joins it into a
fresh `bytes` before the socket sees it. Here each chunk (a view of a tensor) goes to
`sendall` as it is.

Only the download of the global model and the upload of an update take this path, and
only where httpx would have connected directly: where a proxy in the environment applies
(which httpx honours), both go through httpx. TLS uses the same trust as the httpx client
(certifi's CAs, or the CA file given, or none with `verify=False`). Errors come out as httpx's, so the
client's retry loop and error reporting treat both paths alike.
"""

from __future__ import annotations

import http.client
import ssl
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx

__all__ = ["Direct", "direct_request", "is_direct"]

# The most a single readinto asks for, so the hash thread receives the body in batches.
READ_BYTES = 1 << 20


def is_direct(url: str) -> bool:
    """Whether httpx would connect to `url` without a proxy (environment settings)."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return True
    return bool(urllib.request.proxy_bypass(parts.hostname or ""))


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
