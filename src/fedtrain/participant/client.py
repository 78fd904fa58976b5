"""HTTP client of a participant: every call to the coordinator, with named timeouts and
bounded retries, and the one place where httpx errors become fedtrain errors.

Every request fedtrain makes is idempotent (join by name, heartbeat, upload per (round,
participant), downloads, status), so a transient failure — connection refused while the
coordinator restarts, a timeout, a 502/503/504 — is retried with exponential backoff and
jitter, bounded by `RetryPolicy.max_elapsed_s`; after that `CoordinatorUnavailable`.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from fedtrain.errors import (
    AuthError,
    CoordinatorError,
    CoordinatorUnavailable,
    RoundClosedError,
    WireError,
)
from fedtrain.participant import fetch
from fedtrain.participant.fetch import direct_request, is_direct
from fedtrain.wire import DIGEST_HEADER, BodyReader, EncodedBody, TensorSpec
from fedtrain.wire.digest import BackgroundDigest, parse_digest, verify_digest

log = logging.getLogger("fedtrain.participant")

VERSION_HEADER = "X-Fedtrain-Version"

# httpcore reads a response 64 KiB at a time and runs its HTTP/1.1 parser per read, which
# caps a model download at ~0.7 GB/s; 1 MiB reads move a 400 MB model ~2.5x faster. The size
# is a class attribute of httpcore's connection, so this raises it for the process; a read
# returns what the socket has, never waits to fill 1 MiB.
READ_BYTES = 1 << 20


def _use_larger_reads() -> bool:
    try:
        from httpcore._sync.http11 import HTTP11Connection
    except ImportError:  # a future httpcore: keep its default
        return False
    if getattr(HTTP11Connection, "READ_NUM_BYTES", READ_BYTES) < READ_BYTES:
        HTTP11Connection.READ_NUM_BYTES = READ_BYTES
    return True


_use_larger_reads()
_RETRY_STATUS = {502, 503, 504}


@dataclass(frozen=True)
class Timeouts:
    """Seconds. `read` bounds the silence between two bytes, so it covers long-polls too."""

    connect: float = 5.0
    read: float = 90.0
    write: float = 90.0
    pool: float = 10.0

    def httpx(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect, read=self.read, write=self.write, pool=self.pool)


@dataclass(frozen=True)
class RetryPolicy:
    initial_s: float = 0.5
    max_backoff_s: float = 10.0
    max_elapsed_s: float = 300.0

    def delays(self) -> Iterator[float]:
        """Backoff delays (with jitter) until max_elapsed_s is spent."""
        spent, delay = 0.0, self.initial_s
        while spent < self.max_elapsed_s:
            d = min(delay, self.max_backoff_s) * (0.5 + random.random() / 2)
            d = min(d, self.max_elapsed_s - spent)
            spent += d
            yield d
            delay *= 2


def _error_from(response: httpx.Response) -> CoordinatorError:
    try:
        err = response.json()["error"]
        message, code, details = err["message"], err.get("code", "error"), err.get("details") or {}
    except Exception:  # noqa: BLE001 - not our JSON shape (a proxy, say): report the status
        message, code, details = f"HTTP {response.status_code}: {response.text[:200]}", "http_error", {}
    status = response.status_code
    if status in (401, 403):
        return AuthError(message, status=status, code=code, details=details)
    if status == 409 and code in ("round_closed", "run_finished"):
        return RoundClosedError(message, status=status, code=code, details=details)
    return CoordinatorError(message, status=status, code=code, details=details)


def tls_context(verify: bool | str) -> bool | ssl.SSLContext:
    """httpx's `verify`: True (system CAs), False (no verification), or a context trusting a CA file."""
    if isinstance(verify, str):
        try:
            return ssl.create_default_context(cafile=verify)
        except (OSError, ssl.SSLError) as e:
            raise CoordinatorError(f"cannot use {verify} as a CA certificate: {e}", code="tls_error") from None
    return verify


def _certificate_error(error: BaseException) -> str | None:
    """The reason when `error` is (caused by) a failed certificate verification."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen.verify_message or str(seen)
        if "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return "certificate verify failed"
        seen = seen.__cause__ or seen.__context__
    return None


class _ModelBody:
    """What both download paths share: parse the body into place, hash it on a worker
    thread (overlapping with the network and the copies), check length and digest before
    anything is returned. A context manager: the hash thread ends with it."""

    def __init__(self, headers: httpx.Headers, allocate: Callable[[TensorSpec], torch.Tensor] | None,
                 on_header: Callable[[dict[str, TensorSpec], dict[str, str]], None] | None) -> None:
        self.length = int(headers["content-length"]) if "content-length" in headers else None
        self.expected = headers.get(DIGEST_HEADER)
        self.version = int(headers.get(VERSION_HEADER, -1))
        self.reader = BodyReader(expected_length=self.length, allocate=allocate, on_header=on_header)
        self.hasher = BackgroundDigest(parse_digest(self.expected)[0]) if self.expected is not None else None
        self.out: dict[str, torch.Tensor] = {}

    def feed(self, chunk: bytes) -> None:
        self.out.update(self.reader.feed(chunk))
        if self.hasher is not None:
            self.hasher.update(chunk)

    def wrote(self, region: memoryview, n: int) -> None:
        """`n` bytes were read into the start of `reader.writable()`, i.e. `region`."""
        if self.hasher is not None:
            self.hasher.update(region[:n])  # the tensor's own memory: written once, never again
        self.out.update(self.reader.wrote(n))

    def finish(self) -> tuple[int, dict[str, torch.Tensor]]:
        self.reader.finish()  # a body cut short: WireError, which the retry loop retries
        if self.length is not None and self.reader.bytes_received != self.length:
            raise WireError(f"the model body is {self.reader.bytes_received} bytes, its Content-Length {self.length}")
        if self.hasher is not None and self.expected is not None:
            got, self.hasher = self.hasher.digest(), None
            verify_digest(got, self.expected)
        return self.version, self.out

    def __enter__(self) -> _ModelBody:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.hasher is not None:
            self.hasher.close()


class CoordinatorClient:
    """Talks to one coordinator with one bearer token."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeouts: Timeouts = Timeouts(),
        retry: RetryPolicy = RetryPolicy(),
        verify: bool | str = True,
    ) -> None:
        self.url = url.rstrip("/")
        self.retry = retry
        self._token, self._timeouts, self._verify = token, timeouts, verify
        self._tls = tls_context(verify)
        self._http = httpx.Client(
            base_url=self.url,
            timeout=timeouts.httpx(),
            verify=self._tls,
            headers={"Authorization": f"Bearer {token}", "User-Agent": "fedtrain-participant"},
        )

    @functools.cached_property
    def _direct_tls(self) -> ssl.SSLContext:
        """The httpx client's TLS trust as a context for `fetch.direct_request`, built on the
        first download (loading certifi's CAs takes a moment) and kept."""
        return fetch.ssl_context(self._tls)

    def close(self) -> None:
        self._http.close()

    def clone(self, retry: RetryPolicy | None = None) -> CoordinatorClient:
        """A second client to the same coordinator (its own connections), e.g. for heartbeats."""
        return CoordinatorClient(
            self.url, self._token, timeouts=self._timeouts, retry=retry or self.retry, verify=self._verify
        )

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the retry boundary ------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        delays = self.retry.delays()
        while True:
            try:
                return fn()
            except CoordinatorError as e:
                if e.status not in _RETRY_STATUS:
                    raise
                problem: str = e.message
            except (httpx.TransportError, WireError) as e:
                if _certificate_error(e):  # retrying cannot fix a certificate: say so at once
                    raise CoordinatorError(
                        f"{what}: the TLS certificate of {self.url} cannot be verified ({_certificate_error(e)}); "
                        "pass the CA that signed it (--ca-cert PEM), or --insecure for a test setup",
                        status=0,
                        code="tls_error",
                    ) from None
                # A download cut short surfaces as a WireError (truncated body): retry it too.
                problem = f"{type(e).__name__}: {e}"
            delay = next(delays, None)
            if delay is None:
                raise CoordinatorUnavailable(
                    f"{what}: the coordinator at {self.url} did not answer within "
                    f"{self.retry.max_elapsed_s:g}s ({problem})",
                    status=0,
                    code="unavailable",
                )
            log.warning("%s failed (%s); retrying in %.1fs", what, problem, delay)
            time.sleep(delay)

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        def once() -> Any:
            r = self._http.request(method, path, **kwargs)
            if r.status_code >= 400:
                raise _error_from(r)
            return r.json()

        return self._call(f"{method} {path}", once)

    # -- the routes ----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/v1/healthz")

    def join(self, name: str | None, info: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._json("POST", "/v1/join", json={"name": name, "info": info or {}})

    def get_config(self, round_: int | None = None) -> dict[str, Any]:
        """The config in force now, or at round `round_`: {"version", "config", ...}."""
        return self._json("GET", "/v1/config", params={} if round_ is None else {"round": round_})

    def change_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Admin token: change the run config live (in force from the next round boundary)."""
        return self._json("PUT", "/v1/config", json={"changes": changes})

    def validate_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Admin token: dry run of a change: {"valid", "error", "diff"}; nothing is applied."""
        return self._json("POST", "/v1/config/validate", json={"changes": changes})

    def config_history(self, limit: int = 50) -> list[dict[str, Any]]:
        """Accepted config versions, newest first: version, created_at, author, diff, effective_round."""
        return self._json("GET", "/v1/config/history", params={"limit": limit})["versions"]

    def events(self, stop: Callable[[], bool] | None = None) -> Iterator[tuple[str, Any]]:
        """Server-sent events of the run as (kind, data), one connection, no retry: the caller
        reconnects. Ends when the server closes the stream or `stop()` is true at an event."""
        with self._http.stream("GET", "/v1/stream", timeout=httpx.Timeout(5.0, read=60.0)) as r:
            if r.status_code >= 400:
                r.read()
                raise _error_from(r)
            kind, data = "message", ""
            for line in r.iter_lines():
                if stop is not None and stop():
                    return
                if line.startswith("event:"):
                    kind = line[6:].strip()
                elif line.startswith("data:"):
                    data += line[5:].strip()
                elif line == "" and data:
                    yield kind, json.loads(data)
                    kind, data = "message", ""

    def status(self) -> dict[str, Any]:
        return self._json("GET", "/v1/status")

    def metrics(self, name: str | None = None, limit: int = 10000) -> list[dict[str, Any]]:
        """Reported metrics, oldest first: participants' train loss and evals, the global evals."""
        params: dict[str, Any] = {"limit": limit}
        if name is not None:
            params["name"] = name
        return self._json("GET", "/v1/metrics", params=params)["metrics"]

    def heartbeat(self, pid: str, **stats: Any) -> dict[str, Any]:
        return self._json("POST", f"/v1/participants/{pid}/heartbeat", json=stats)

    def leave(self, pid: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/participants/{pid}/leave")

    def report(
        self, pid: str, values: dict[str, float], *, round_: int | None = None, step: int | None = None
    ) -> dict[str, Any]:
        return self._json(
            "POST", f"/v1/participants/{pid}/metrics", json={"round": round_, "step": step, "values": values}
        )

    def wait_round(self, round_: int, pid: str | None = None, wait_s: float = 25.0) -> dict[str, Any]:
        params: dict[str, Any] = {"wait": wait_s}
        if pid is not None:
            params["participant_id"] = pid
        return self._json("GET", f"/v1/rounds/{round_}", params=params)

    def upload(self, round_: int, pid: str, body: EncodedBody, tokens: int) -> dict[str, Any]:
        """PUT one pseudo-gradient; RoundClosedError (409) when the round is already over."""
        headers = {
            DIGEST_HEADER: body.digest(),
            "Content-Length": str(body.content_length),
            "Content-Type": "application/octet-stream",
        }

        def once() -> Any:
            if is_direct(self.url):
                return self._upload_direct(f"/v1/rounds/{round_}/updates/{pid}", {"tokens": tokens}, headers, body)
            r = self._http.put(
                f"/v1/rounds/{round_}/updates/{pid}",
                params={"tokens": tokens},
                content=iter(body),  # type: ignore[arg-type]
                headers=headers,
            )
            if r.status_code >= 400:
                raise _error_from(r)
            return r.json()

        return self._call(f"upload of round {round_}", once)

    def download(
        self,
        *,
        version: int | None = None,
        pid: str | None = None,
        allocate: Callable[[TensorSpec], torch.Tensor] | None = None,
        on_header: Callable[[dict[str, TensorSpec], dict[str, str]], None] | None = None,
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Stream the global model; returns (version, tensors). Each tensor is read straight
        into the storage `allocate` gives (e.g. a parameter), one copy per byte."""
        params: dict[str, Any] = {}
        if version is not None:
            params["version"] = version
        if pid is not None:
            params["participant_id"] = pid

        def once() -> tuple[int, dict[str, torch.Tensor]]:
            if is_direct(self.url):
                return self._download_direct(params, allocate, on_header)
            with self._http.stream("GET", "/v1/model", params=params) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _error_from(r)
                with _ModelBody(r.headers, allocate, on_header) as body:
                    # No chunk size: httpx would re-chunk through a BytesIO (three more copies
                    # per byte); socket reads come at most `READ_NUM_BYTES` (1 MiB) at a time.
                    for chunk in r.iter_raw():
                        body.feed(chunk)
                    return body.finish()

        return self._call("download of the global model", once)

    def _upload_direct(self, path: str, params: dict[str, Any], headers: dict[str, str], body: EncodedBody) -> Any:
        """`upload` over `fetch.direct_request`: the body's chunks go to the socket as they are."""
        fields = {**headers, "Authorization": f"Bearer {self._token}", "User-Agent": "fedtrain-participant"}
        with direct_request("PUT", self.url, path, params, fields, body=body, connect_timeout=self._timeouts.connect,
                            read_timeout=self._timeouts.read, write_timeout=self._timeouts.write,
                            tls=self._direct_tls) as r:
            answer = r.as_httpx()
        if answer.status_code >= 400:
            raise _error_from(answer)
        return answer.json()

    def _download_direct(
        self, params: dict[str, Any], allocate: Callable[[TensorSpec], torch.Tensor] | None,
        on_header: Callable[[dict[str, TensorSpec], dict[str, str]], None] | None,
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """`download` over `fetch.direct_request`: socket reads land in the tensors' storage."""
        headers = {"Authorization": f"Bearer {self._token}", "User-Agent": "fedtrain-participant"}
        with direct_request("GET", self.url, "/v1/model", params, headers, connect_timeout=self._timeouts.connect,
                            read_timeout=self._timeouts.read, tls=self._direct_tls) as r:
            if r.status >= 400:
                raise _error_from(r.as_httpx())
            with _ModelBody(r.headers, allocate, on_header) as body:
                reader = body.reader
                while not reader.done:
                    region = reader.writable()
                    if region is None:  # the prefix and the header: read exactly those
                        chunk = r.read(reader.head_needed)
                        if not chunk:
                            break
                        body.feed(chunk)
                        continue
                    n = r.readinto(region)
                    if not n:
                        break
                    body.wrote(region, n)
                return body.finish()
