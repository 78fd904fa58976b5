"""What the coordinator's answers and a failed call mean, for `client.py`: its one JSON error
shape and the error each refusal becomes, Retry-After, what a call that got no answer ran
into (TLS and certificate failures told apart from outages), and what to say on giving up."""

from __future__ import annotations

import email.utils
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from fedtrain.errors import AuthError, CoordinatorError, NotACoordinatorError, RoundClosedError, TLSError

#: OpenSSL's reasons when a TLS client met a server that speaks plain HTTP.
PLAIN_TEXT_REASONS = {"WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE", "UNKNOWN_PROTOCOL"}
#: The statuses a call retries: too many requests (429), and a coordinator or proxy in trouble.
RETRY_STATUS = {429, 502, 503, 504}


@dataclass(frozen=True)
class Address:
    """Where a coordinator is: its URL (no trailing slash) and the parts of it the errors name."""

    url: str
    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Address:
        parts = urlsplit(url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise NotACoordinatorError(
                f"{url!r} is not a coordinator URL: give http://HOST:PORT or https://HOST:PORT", code="bad_url"
            )
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(url.rstrip("/"), parts.scheme, parts.hostname, port)

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Failure:
    """One failed attempt: what happened (logged while retrying), and what to check if it lasts."""

    what: str
    advice: str = ""
    refused: bool = False


def error_body(response: httpx.Response) -> tuple[str, str, dict[str, Any]] | None:
    """(message, code, details) when the body is the coordinator's JSON error shape, else None."""
    try:
        err = response.json()["error"]
        message, code, details = err["message"], err.get("code", "error"), err.get("details") or {}
    except Exception:  # noqa: BLE001 - not our JSON shape: an HTML page, a proxy, another server
        return None
    if not isinstance(message, str) or not isinstance(details, dict):
        return None
    return message, str(code), details


def retry_after(response: httpx.Response) -> float | None:
    """The seconds a Retry-After header asks for (a number, or an HTTP date), or None."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


_default_tls: list[ssl.SSLContext] = []
_default_tls_lock = threading.Lock()


def tls_context(verify: bool | str) -> bool | ssl.SSLContext:
    """httpx's `verify`: False (no verification), a context trusting a CA file, or for True the
    context httpx would make (its CAs, SSL_CERT_FILE and SSL_CERT_DIR), made once per process and
    shared by every client: loading the CAs takes ~0.25 s of CPU, and a participant makes a
    client per thread that calls (heartbeats, the event stream, uploads) and per rejoin."""
    if isinstance(verify, str):
        try:
            return ssl.create_default_context(cafile=verify)
        except (OSError, ssl.SSLError) as e:
            raise TLSError(f"cannot use {verify} as a CA certificate: {e}", code="tls_error") from None
    make = getattr(httpx, "create_ssl_context", None)  # public from httpx 0.28
    if not verify or make is None:
        return verify
    with _default_tls_lock:
        if not _default_tls:
            _default_tls.append(make())
        return _default_tls[0]


def cause_of(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    """`error` or the first exception of that kind among its causes."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def certificate_error(error: BaseException) -> str | None:
    """The reason when `error` is (caused by) a failed certificate verification."""
    found = cause_of(error, ssl.SSLCertVerificationError)
    if isinstance(found, ssl.SSLCertVerificationError):
        return found.verify_message or str(found)
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return None
        if "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return "certificate verify failed"
        seen = seen.__cause__ or seen.__context__
    return None


def not_a_coordinator(address: Address, why: str, status: int = 0) -> NotACoordinatorError:
    if status == 413:  # the coordinator answers 413 in its JSON shape: this one came from in between
        return NotACoordinatorError(
            f"something between you and the coordinator at {address.url} refused the body as too large ({why}): "
            "a reverse proxy's body limit is below the run's max_upload_mb (nginx: client_max_body_size; "
            "docs/deploy.md)", status=status, code="proxy_body_limit")
    return NotACoordinatorError(
        f"{address.url} does not look like a fedtrain coordinator ({why}): check the address and port",
        status=status,
        code="not_a_coordinator",
    )


def refusal(
    address: Address, response: httpx.Response, where: str, body: tuple[str, str, dict[str, Any]] | None
) -> CoordinatorError:
    """The error for an answer of 400 or more to `where` ("METHOD /path"), whose `error_body`
    is `body`. Never the body of a page that is not the coordinator's JSON: only its status
    goes into the message."""
    status = response.status_code
    if body is None:
        if status in RETRY_STATUS:  # a proxy in front of a coordinator that restarts: retried
            return CoordinatorError(
                f"HTTP {status} {response.reason_phrase} from {where}, not from the coordinator (a proxy?)",
                status=status,
                code="http_error",
            )
        return not_a_coordinator(address, f"HTTP {status} from {where}", status)
    message, code, details = body
    wait = retry_after(response)
    if wait is not None and "retry_after_s" not in details:
        details = {**details, "retry_after_s": wait}
    if status == 404 and code == "not_found":  # no such route (not a 404 of the run's own, e.g. no_config)
        return not_a_coordinator(address, f"HTTP 404 from {where}", status)
    if status in (401, 403):
        refused = "the token: " if status == 401 else "the request: "
        advice = " (check --token or $FEDTRAIN_TOKEN)" if status == 401 else ""
        return AuthError(
            f"the coordinator at {address.url} refused {refused}{message}{advice}",
            status=status,
            code=code,
            details=details,
        )
    if status == 409 and code in ("round_closed", "run_finished", "too_stale"):  # (too_stale: asynchronous mode)
        return RoundClosedError(message, status=status, code=code, details=details)
    return CoordinatorError(message, status=status, code=code, details=details)


def transport_failure(
    address: Address, what: str, error: Exception, *, connect_timeout_s: float, speaks_tls: Callable[[], bool]
) -> Failure:
    """A failed attempt that got no answer, described; raises TLSError where retrying cannot help.
    `speaks_tls()`: whether the port, reached over http://, would speak TLS (asked only when
    the other end hung up without an answer)."""
    url, where = address.url, address.where
    cert = certificate_error(error)
    if cert:
        raise TLSError(
            f"{what}: the TLS certificate of {url} cannot be verified ({cert}); "
            "pass the CA that signed it (--ca-cert PEM), or --insecure for a test setup",
            code="tls_error",
        ) from None
    ssl_error = cause_of(error, ssl.SSLError)
    if address.scheme == "https" and getattr(ssl_error, "reason", None) in PLAIN_TEXT_REASONS:
        raise TLSError(
            f"{what}: the coordinator at {url} does not speak TLS: use http://{where} "
            "(or start the coordinator with --tls-cert and --tls-key)",
            code="tls_error",
        ) from None
    if cause_of(error, ConnectionRefusedError) is not None:
        return Failure(f"connection refused at {where}", "is the coordinator running, and is that its port?",
                       refused=True)
    unknown = cause_of(error, socket.gaierror)
    if isinstance(unknown, socket.gaierror):
        return Failure(f"the host name {address.host} does not resolve ({unknown.strerror})", "check the address")
    if isinstance(error, httpx.ConnectTimeout):
        return Failure(f"no answer from {where} within {connect_timeout_s:g}s (connect timeout)",
                       "is the address right, and does a firewall let that port through?")
    if isinstance(error, (httpx.RemoteProtocolError, httpx.ReadError)) and speaks_tls():
        raise TLSError(
            f"{what}: the coordinator at {url} speaks TLS: use https://{where} "
            "(with --ca-cert PEM if its certificate is self-signed)",
            code="tls_error",
        ) from None
    # A download cut short surfaces as a WireError (truncated body): retry it too.
    return Failure(f"{type(error).__name__}: {error}")


def gave_up(address: Address, what: str, failure: Failure, budget_s: float, *, reached: bool) -> str:
    """What a call says when its retries are spent; `reached`: the coordinator had answered before."""
    if failure.refused and reached:
        return f"{what}: {failure.what} for {budget_s:g}s: the coordinator answered before; is it still running?"
    if failure.advice:
        return f"{what}: {failure.what}: {failure.advice} (retried for {budget_s:g}s)"
    return f"{what}: the coordinator at {address.url} did not answer within {budget_s:g}s ({failure.what})"
