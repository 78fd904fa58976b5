"""What the coordinator's answers and a failed call mean, for `client.py`: its one JSON error
shape, Retry-After, and TLS and certificate failures told apart from outages."""

from __future__ import annotations

import email.utils
import math
import ssl
import time
from dataclasses import dataclass
from typing import Any

import httpx

from fedtrain.errors import TLSError

#: OpenSSL's reasons when a TLS client met a server that speaks plain HTTP.
PLAIN_TEXT_REASONS = {"WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE", "UNKNOWN_PROTOCOL"}


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


def tls_context(verify: bool | str) -> bool | ssl.SSLContext:
    """httpx's `verify`: True (system CAs), False (no verification), or a context trusting a CA file."""
    if isinstance(verify, str):
        try:
            return ssl.create_default_context(cafile=verify)
        except (OSError, ssl.SSLError) as e:
            raise TLSError(f"cannot use {verify} as a CA certificate: {e}", code="tls_error") from None
    return verify


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
