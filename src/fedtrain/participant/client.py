"""HTTP client of a participant: every call to the coordinator, with named timeouts and
bounded retries, and the one place where httpx errors become fedtrain errors.

Every request fedtrain makes is idempotent (join by name, heartbeat, upload per (round,
participant), downloads, status), so a transient failure — connection refused while the
coordinator restarts, a timeout, a 502/503/504, a 429 (too many requests: an upload of
ours still in progress on another connection) — is retried with exponential backoff and
jitter, or after the Retry-After the answer names (at most `RetryPolicy.max_backoff_s`),
bounded by `RetryPolicy.max_elapsed_s`; after that `CoordinatorUnavailable`.

A participant acts only as itself: its join answer carries a participant key, which the
client keeps (shared with its clones) and presents on every call that speaks for that
participant (`X-Fedtrain-Participant-Key`), and on a later join by the same name (a
rejoin as itself). A join refused because the name's earlier holder is still active
(409 `name_in_use`: this participant restarted without its key) is retried until that
holder fails by heartbeat timeout, within the same bound.

Until the coordinator has answered once, an address that refuses connections is more likely
wrong than restarting, so those retries stop after `RetryPolicy.first_contact_s`. Errors
that retrying cannot fix fail at once, saying what to change: TLS that does not match the
URL's scheme or a certificate not trusted (`TLSError`), something at the address that is
not a fedtrain coordinator (`NotACoordinatorError`), a refused token (`AuthError`).

No torch here at module level: `fedtrain status` uses this client and never a tensor.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from fedtrain.errors import (
    AuthError,
    CoordinatorError,
    CoordinatorUnavailable,
    NotACoordinatorError,
    RoundClosedError,
    TLSError,
    WireError,
)
from fedtrain.participant import fetch
from fedtrain.participant.answers import (
    PLAIN_TEXT_REASONS,
    Failure,
    cause_of,
    certificate_error,
    error_body,
    retry_after,
    tls_context,
)
from fedtrain.participant.fetch import VERSION_HEADER, ModelBody, direct_request, is_direct

if TYPE_CHECKING:
    import torch

    from fedtrain.wire.encode import EncodedBody
    from fedtrain.wire.format import TensorSpec

__all__ = ["VERSION_HEADER", "CoordinatorClient", "RetryPolicy", "Timeouts", "tls_context"]

log = logging.getLogger("fedtrain.participant")

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
_RETRY_STATUS = {429, 502, 503, 504}
KEY_HEADER = "X-Fedtrain-Participant-Key"  # the coordinator's `auth.KEY_HEADER`
# What OpenSSL says when the other end answers a ClientHello in plain text (its versions differ).


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
    """Backoff of one call to the coordinator. Seconds, counted in waits between attempts."""

    initial_s: float = 0.5  # the first wait; doubles after each failed attempt
    max_backoff_s: float = 10.0  # the longest single wait
    max_elapsed_s: float = 300.0  # all the waits of one call, once the coordinator has answered this client
    first_contact_s: float = 20.0  # the same before it ever has (a wrong address fails sooner than an outage)

    def __post_init__(self) -> None:
        if min(self.initial_s, self.max_backoff_s, self.max_elapsed_s, self.first_contact_s) < 0:
            raise ValueError(f"RetryPolicy seconds must not be negative: {self}")

    def budget_s(self, first_contact: bool) -> float:
        return min(self.first_contact_s, self.max_elapsed_s) if first_contact else self.max_elapsed_s

    def next_delay(self, attempt: int, spent_s: float, *, first_contact: bool,
                   hint_s: float | None = None) -> float | None:
        """The wait (with jitter) after failed attempt number `attempt` (0 first), `spent_s`
        seconds of waits into the call; None once the budget is spent. `hint_s`: what the
        answer asked for (Retry-After), taken within [initial_s, max_backoff_s]."""
        budget = self.budget_s(first_contact)
        if spent_s >= budget:
            return None
        if hint_s is not None and math.isfinite(hint_s):
            delay = min(max(hint_s, self.initial_s, 0.01), self.max_backoff_s)
        else:
            delay = min(self.initial_s * 2**attempt, self.max_backoff_s) * (0.5 + random.random() / 2)
        return min(delay, budget - spent_s)


class CoordinatorClient:
    """Talks to one coordinator with one bearer token, as the participants it joined."""

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
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise NotACoordinatorError(
                f"{url!r} is not a coordinator URL: give http://HOST:PORT or https://HOST:PORT", code="bad_url"
            )
        self._scheme, self._host = parts.scheme, parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        # Has the coordinator ever answered this client (or the one it was cloned from)? Only ever
        # goes from False to True, so the threads that share a client need no lock for it.
        self._reached = False
        # Participant id -> its participant key (the join answer's). Shared with clones; a key
        # is only ever replaced whole, so the threads that share it need no lock.
        self._keys: dict[str, str] = {}
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

    @property
    def reached(self) -> bool:
        """Whether the coordinator has answered this client once: from then on a refused
        connection is an outage (retried for `retry.max_elapsed_s`), before it a likely wrong
        address (retried for `retry.first_contact_s`)."""
        return self._reached

    def close(self) -> None:
        self._http.close()

    def clone(self, retry: RetryPolicy | None = None) -> CoordinatorClient:
        """A second client to the same coordinator (its own connections), e.g. for heartbeats."""
        other = CoordinatorClient(
            self.url, self._token, timeouts=self._timeouts, retry=retry or self.retry, verify=self._verify
        )
        other._reached = self._reached  # the same coordinator: what this one learnt holds for both
        other._keys = self._keys  # and it speaks for the same participants
        return other

    def participant_key(self, pid: str) -> str | None:
        """The participant key this client holds for participant `pid` (never log it)."""
        return self._keys.get(pid)

    def remember_key(self, pid: str, key: str) -> None:
        """Hold `key` as participant `pid`'s: presented on its calls, and at a join as `pid`
        (e.g. a key kept on disk by a participant that restarts, to rejoin as itself)."""
        self._keys[pid] = key

    def _as(self, pid: str | None) -> dict[str, str]:
        """The header that lets a call speak for participant `pid` (none when no key is held)."""
        key = self._keys.get(pid) if pid is not None else None
        return {KEY_HEADER: key} if key else {}

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the retry boundary ------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], Any], also_retry: frozenset[str] = frozenset()) -> Any:
        """`fn()`, retried on transient failures and on refusals whose code is in `also_retry`
        (raised as they are once the budget is spent)."""
        attempt, spent = 0, 0.0
        while True:
            hint: float | None = None
            try:
                result = fn()
                self._reached = True
                return result
            except CoordinatorError as e:
                if e.status not in _RETRY_STATUS and e.code not in also_retry:
                    raise
                failure, hint, refusal = Failure(e.message), e.details.get("retry_after_s"), e
            except (httpx.TransportError, WireError) as e:
                failure, refusal = self._transport_failure(what, e), None  # raises at once what retrying cannot fix
            first_contact = not self._reached
            delay = self.retry.next_delay(attempt, spent, first_contact=first_contact,
                                          hint_s=float(hint) if isinstance(hint, (int, float)) else None)
            if delay is None:
                if refusal is not None and refusal.code in also_retry:
                    raise refusal
                raise CoordinatorUnavailable(
                    self._gave_up(what, failure, self.retry.budget_s(first_contact)), status=0, code="unavailable"
                )
            log.warning("%s failed (%s); retrying in %.1fs", what, failure.what, delay)
            time.sleep(delay)
            attempt, spent = attempt + 1, spent + delay

    def _gave_up(self, what: str, failure: Failure, budget_s: float) -> str:
        if failure.refused and self._reached:
            return f"{what}: {failure.what} for {budget_s:g}s: the coordinator answered before; is it still running?"
        if failure.advice:
            return f"{what}: {failure.what}: {failure.advice} (retried for {budget_s:g}s)"
        return f"{what}: the coordinator at {self.url} did not answer within {budget_s:g}s ({failure.what})"

    def _transport_failure(self, what: str, error: Exception) -> Failure:
        """A failed attempt that got no answer, described; raises TLSError where retrying cannot help."""
        where = f"{self._host}:{self._port}"
        cert = certificate_error(error)
        if cert:
            raise TLSError(
                f"{what}: the TLS certificate of {self.url} cannot be verified ({cert}); "
                "pass the CA that signed it (--ca-cert PEM), or --insecure for a test setup",
                code="tls_error",
            ) from None
        ssl_error = cause_of(error, ssl.SSLError)
        if self._scheme == "https" and getattr(ssl_error, "reason", None) in PLAIN_TEXT_REASONS:
            raise TLSError(
                f"{what}: the coordinator at {self.url} does not speak TLS: use http://{where} "
                "(or start the coordinator with --tls-cert and --tls-key)",
                code="tls_error",
            ) from None
        if cause_of(error, ConnectionRefusedError) is not None:
            return Failure(f"connection refused at {where}", "is the coordinator running, and is that its port?",
                            refused=True)
        unknown = cause_of(error, socket.gaierror)
        if isinstance(unknown, socket.gaierror):
            return Failure(f"the host name {self._host} does not resolve ({unknown.strerror})", "check the address")
        if isinstance(error, httpx.ConnectTimeout):
            return Failure(f"no answer from {where} within {self._timeouts.connect:g}s (connect timeout)",
                            "is the address right, and does a firewall let that port through?")
        if isinstance(error, (httpx.RemoteProtocolError, httpx.ReadError)) and self._wants_tls():
            raise TLSError(
                f"{what}: the coordinator at {self.url} speaks TLS: use https://{where} "
                "(with --ca-cert PEM if its certificate is self-signed)",
                code="tls_error",
            ) from None
        # A download cut short surfaces as a WireError (truncated body): retry it too.
        return Failure(f"{type(error).__name__}: {error}")

    def _wants_tls(self) -> bool:
        """At first contact over http://, after the other end hung up without an answer: does
        that port speak TLS? (A TLS server hangs up on plain HTTP; mid-run this is a restart.)"""
        if self._reached or self._scheme != "http" or not is_direct(self.url):
            return False
        return fetch.speaks_tls(self._host, self._port, timeout_s=min(self._timeouts.connect, 2.0))

    def _not_a_coordinator(self, why: str, status: int = 0) -> NotACoordinatorError:
        return NotACoordinatorError(
            f"{self.url} does not look like a fedtrain coordinator ({why}): check the address and port",
            status=status,
            code="not_a_coordinator",
        )

    def _refusal(self, response: httpx.Response, where: str) -> CoordinatorError:
        """The error for an answer of 400 or more to `where` ("METHOD /path"). Never the body
        of a page that is not the coordinator's JSON: only its status goes into the message."""
        status = response.status_code
        body = error_body(response)
        if body is None:
            if status in _RETRY_STATUS:  # a proxy in front of a coordinator that restarts: retried
                return CoordinatorError(
                    f"HTTP {status} {response.reason_phrase} from {where}, not from the coordinator (a proxy?)",
                    status=status,
                    code="http_error",
                )
            return self._not_a_coordinator(f"HTTP {status} from {where}", status)
        self._reached = True
        message, code, details = body
        wait = retry_after(response)
        if wait is not None and "retry_after_s" not in details:
            details = {**details, "retry_after_s": wait}
        if status == 404 and code == "not_found":  # no such route (not a 404 of the run's own, e.g. no_config)
            return self._not_a_coordinator(f"HTTP 404 from {where}", status)
        if status in (401, 403):
            refused = "the token: " if status == 401 else "the request: "
            advice = " (check --token or $FEDTRAIN_TOKEN)" if status == 401 else ""
            return AuthError(
                f"the coordinator at {self.url} refused {refused}{message}{advice}",
                status=status,
                code=code,
                details=details,
            )
        if status == 409 and code in ("round_closed", "run_finished"):
            return RoundClosedError(message, status=status, code=code, details=details)
        return CoordinatorError(message, status=status, code=code, details=details)

    def _answer(self, response: httpx.Response, where: str) -> Any:
        """The JSON of a (small) answer, or the error it stands for."""
        if response.status_code >= 400:
            raise self._refusal(response, where)
        try:
            return response.json()
        except ValueError:
            kind = response.headers.get("content-type", "no content type").split(";")[0]
            why = f"its answer to {where} is not JSON but {kind}"
            raise self._not_a_coordinator(why, response.status_code) from None

    def _json(self, method: str, path: str, *, also_retry: frozenset[str] = frozenset(), **kwargs: Any) -> Any:
        what = f"{method} {path}"
        return self._call(what, lambda: self._answer(self._http.request(method, path, **kwargs), what), also_retry)

    # -- the routes ----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._expect(self._json("GET", "/v1/healthz"), "GET /v1/healthz", "ok")

    def join(self, name: str | None, info: dict[str, Any] | None = None) -> dict[str, Any]:
        """Join as `name` (presenting its participant key when this client holds one: a rejoin
        as itself); from then on this client speaks for the participant the answer names.
        A name whose earlier holder is still active is waited for (`name_in_use`)."""
        body = {"name": name, "info": info or {}, "key_cookie": False}  # the key goes in a header: no cookie
        joined = self._json("POST", "/v1/join", json=body, headers=self._as(name),
                            also_retry=frozenset({"name_in_use"}))
        joined = self._expect(joined, "POST /v1/join", "participant_id")
        if isinstance(joined.get("participant_key"), str):
            self._keys[str(joined["participant_id"])] = joined["participant_key"]
        return joined

    def _expect(self, answer: Any, where: str, key: str) -> dict[str, Any]:
        """`answer` when it is the JSON object a coordinator gives (it has `key`)."""
        if not isinstance(answer, dict) or key not in answer:
            raise self._not_a_coordinator(f"its answer to {where} has no {key!r}")
        return answer

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

    def kept_versions(self) -> dict[str, Any]:
        """Admin: the kept versions a roll back can go to, newest first, and the committed version."""
        return self._json("GET", "/v1/admin/checkpoints")

    def roll_back(self, version: int) -> dict[str, Any]:
        """Admin: put kept `version` back in force; answers the new version that holds it."""
        return self._json("POST", "/v1/admin/rollback", json={"version": version})

    def events(self, stop: Callable[[], bool] | None = None) -> Iterator[tuple[str, Any]]:
        """Server-sent events of the run as (kind, data), one connection, no retry: the caller
        reconnects. Ends when the server closes the stream or `stop()` is true at an event."""
        with self._http.stream("GET", "/v1/stream", timeout=httpx.Timeout(5.0, read=60.0)) as r:
            if r.status_code >= 400:
                r.read()
                raise self._refusal(r, "GET /v1/stream")
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
        return self._json("POST", f"/v1/participants/{pid}/heartbeat", json=stats, headers=self._as(pid))

    def leave(self, pid: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/participants/{pid}/leave", headers=self._as(pid))

    def report(
        self, pid: str, values: dict[str, float], *, round_: int | None = None, step: int | None = None
    ) -> dict[str, Any]:
        return self._json(
            "POST", f"/v1/participants/{pid}/metrics", json={"round": round_, "step": step, "values": values},
            headers=self._as(pid),
        )

    def wait_round(self, round_: int, pid: str | None = None, wait_s: float = 25.0) -> dict[str, Any]:
        params: dict[str, Any] = {"wait": wait_s}
        if pid is not None:
            params["participant_id"] = pid
        return self._json("GET", f"/v1/rounds/{round_}", params=params, headers=self._as(pid))

    def upload(self, round_: int, pid: str, body: EncodedBody, tokens: int) -> dict[str, Any]:
        """PUT one pseudo-gradient; RoundClosedError (409) when the round is already over."""
        from fedtrain.wire.digest import DIGEST_HEADER

        path = f"/v1/rounds/{round_}/updates/{pid}"
        headers = {
            DIGEST_HEADER: body.digest(),
            "Content-Length": str(body.content_length),
            "Content-Type": "application/octet-stream",
            **self._as(pid),
        }

        def once() -> Any:
            if is_direct(self.url):
                return self._upload_direct(path, {"tokens": tokens}, headers, body)
            r = self._http.put(path, params={"tokens": tokens}, content=iter(body), headers=headers)  # type: ignore[arg-type]
            return self._answer(r, f"PUT {path}")

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
                return self._download_direct(params, allocate, on_header, self._as(pid))
            with self._http.stream("GET", "/v1/model", params=params, headers=self._as(pid)) as r:
                if r.status_code >= 400:
                    r.read()
                    raise self._refusal(r, "GET /v1/model")
                with ModelBody(r.headers, allocate, on_header) as body:
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
        return self._answer(answer, f"PUT {path}")

    def _download_direct(
        self, params: dict[str, Any], allocate: Callable[[TensorSpec], torch.Tensor] | None,
        on_header: Callable[[dict[str, TensorSpec], dict[str, str]], None] | None, speaks_for: dict[str, str],
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """`download` over `fetch.direct_request`: socket reads land in the tensors' storage."""
        headers = {"Authorization": f"Bearer {self._token}", "User-Agent": "fedtrain-participant", **speaks_for}
        with direct_request("GET", self.url, "/v1/model", params, headers, connect_timeout=self._timeouts.connect,
                            read_timeout=self._timeouts.read, tls=self._direct_tls) as r:
            if r.status >= 400:
                raise self._refusal(r.as_httpx(), "GET /v1/model")
            with ModelBody(r.headers, allocate, on_header) as body:
                return body.read_from(r)
