"""HTTP client of a participant: every call to the coordinator, with named timeouts and bounded
retries, and the one place where httpx errors become fedtrain errors. A participant acts only as
itself (the participant key of its join). No torch at module level: `fedtrain status` uses this
client. See docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import ssl
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import httpx

from fedtrain.errors import CoordinatorError, CoordinatorUnavailable, WireError
from fedtrain.participant.client.answers import (
    RETRY_STATUS,
    Address,
    Failure,
    error_body,
    gave_up,
    not_a_coordinator,
    refusal,
    tls_context,
    transport_failure,
)
from fedtrain.participant.client.retry import RetryPolicy, Timeouts
from fedtrain.participant.client.uploads import KEY_HEADER, UploadCalls
from fedtrain.transport import direct_http as fetch
from fedtrain.transport.direct_http import VERSION_HEADER, direct_request, is_direct
from fedtrain.transport.http_client import tune_httpcore
from fedtrain.transport.parallel import ParallelDownload, StreamChooser
from fedtrain.transport.resume import PartialDownload

if TYPE_CHECKING:
    import torch

    from fedtrain.wire.format import TensorSpec

__all__ = ["VERSION_HEADER", "CoordinatorClient", "RetryPolicy", "Timeouts", "tls_context"]

log = logging.getLogger("fedtrain.participant")



def sse_events(lines: Iterable[str], stop: Callable[[], bool] | None = None) -> Iterator[tuple[str, Any]]:
    """The server-sent events in a stream's `lines`, as (kind, data); comments (keep-alives) carry
    none. Ends with the lines, or once `stop()` is true when a line arrives."""
    kind, data = "message", ""
    for line in lines:
        if stop is not None and stop():
            return
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif line == "" and data:
            yield kind, json.loads(data)
            kind, data = "message", ""


class CoordinatorClient(UploadCalls):
    """Talks to one coordinator with one bearer token, as the participants it joined. Its
    uploads (whole or in parts, resumed, taken over) are `uploads.UploadCalls`'."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeouts: Timeouts = Timeouts(),
        retry: RetryPolicy = RetryPolicy(),
        verify: bool | str = True,
    ) -> None:
        self._address = Address.parse(url)
        self.url = self._address.url
        self.retry = retry  # the default of every call; a call that wants another passes retry=
        self._token, self._timeouts, self._verify = token, timeouts, verify
        # Has the coordinator ever answered this client (or the one it was cloned from)? Only ever
        # goes from False to True, so the threads that share a client need no lock for it.
        self._reached = False
        # Participant id -> its participant key (the join answer's). Shared with clones; a key
        # is only ever replaced whole, so the threads that share it need no lock.
        self._keys: dict[str, str] = {}
        self._tls = tls_context(verify)
        self._streams = StreamChooser()  # `download(streams="auto")`: from this client's downloads
        tune_httpcore()
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

    def _call(self, what: str, fn: Callable[[], Any], also_retry: frozenset[str] = frozenset(),
              retry: RetryPolicy | None = None) -> Any:
        """`fn()`, retried under `retry` (else the client's policy) on transient failures and on
        refusals whose code is in `also_retry` (raised as they are once the budget is spent)."""
        policy = retry or self.retry
        attempt, spent = 0, 0.0
        while True:
            hint: float | None = None
            try:
                result = fn()
                self._reached = True
                return result
            except CoordinatorError as e:
                if e.status not in RETRY_STATUS and e.code not in also_retry:
                    raise
                failure, hint, refused = Failure(e.message), e.details.get("retry_after_s"), e
            except (httpx.TransportError, WireError) as e:
                # raises at once what retrying cannot fix
                failure = transport_failure(self._address, what, e, connect_timeout_s=self._timeouts.connect,
                                            speaks_tls=self._wants_tls)
                refused = None
            first_contact = not self._reached
            delay = policy.next_delay(attempt, spent, first_contact=first_contact,
                                      hint_s=float(hint) if isinstance(hint, (int, float)) else None)
            if delay is None:
                if refused is not None and refused.code in also_retry:
                    raise refused
                budget = policy.budget_s(first_contact)
                why = gave_up(self._address, what, failure, budget, reached=self._reached)
                raise CoordinatorUnavailable(why, status=0, code="unavailable")
            log.warning("%s failed (%s); retrying in %.1fs", what, failure.what, delay)
            time.sleep(delay)
            attempt, spent = attempt + 1, spent + delay

    def _wants_tls(self) -> bool:
        """At first contact over http://, after the other end hung up without an answer: does
        that port speak TLS? (A TLS server hangs up on plain HTTP; mid-run this is a restart.)"""
        a = self._address
        if self._reached or a.scheme != "http" or not is_direct(self.url):
            return False
        return fetch.speaks_tls(a.host, a.port, timeout_s=min(self._timeouts.connect, 2.0))

    def _refusal(self, response: httpx.Response, where: str) -> CoordinatorError:
        """The error an answer of 400 or more stands for (see `answers.refusal`)."""
        body = error_body(response)
        if body is not None:  # the coordinator's own JSON: it has answered
            self._reached = True
        return refusal(self._address, response, where, body)

    def _answer(self, response: httpx.Response, where: str) -> Any:
        """The JSON of a (small) answer, or the error it stands for."""
        if response.status_code >= 400:
            raise self._refusal(response, where)
        try:
            return response.json()
        except ValueError:
            kind = response.headers.get("content-type", "no content type").split(";")[0]
            why = f"its answer to {where} is not JSON but {kind}"
            raise not_a_coordinator(self._address, why, response.status_code) from None

    def _json(self, method: str, path: str, *, also_retry: frozenset[str] = frozenset(),
              retry: RetryPolicy | None = None, **kwargs: Any) -> Any:
        what = f"{method} {path}"
        return self._call(what, lambda: self._answer(self._http.request(method, path, **kwargs), what), also_retry,
                          retry)

    # -- the routes (each takes `retry=`: its own policy instead of the client's) --------------

    def health(self, *, retry: RetryPolicy | None = None) -> dict[str, Any]:
        return self._expect(self._json("GET", "/v1/healthz", retry=retry), "GET /v1/healthz", "ok")

    def join(self, name: str | None, info: dict[str, Any] | None = None, *,
             model: dict[str, dict[str, Any]] | None = None, retry: RetryPolicy | None = None) -> dict[str, Any]:
        """Join as `name` (presenting its participant key when this client holds one: a rejoin
        as itself); from then on this client speaks for the participant the answer names.
        A name whose earlier holder is still active is waited for (`name_in_use`). `model`: the
        tensors we sync (name -> {"dtype", "shape"}): a run whose model differs refuses the join
        (CoordinatorError model_mismatch) and keeps nothing of it."""
        body: dict[str, Any] = {"name": name, "info": info or {}, "key_cookie": False}  # the key: a header
        if model is not None:
            body["model"] = model
        joined = self._json("POST", "/v1/join", json=body, headers=self._as(name),
                            also_retry=frozenset({"name_in_use"}), retry=retry)
        joined = self._expect(joined, "POST /v1/join", "participant_id")
        if isinstance(joined.get("participant_key"), str):
            self._keys[str(joined["participant_id"])] = joined["participant_key"]
        return joined

    def _expect(self, answer: Any, where: str, key: str) -> dict[str, Any]:
        """`answer` when it is the JSON object a coordinator gives (it has `key`)."""
        if not isinstance(answer, dict) or key not in answer:
            raise not_a_coordinator(self._address, f"its answer to {where} has no {key!r}")
        return answer

    def get_config(self, round_: int | None = None, *, participant_id: str | None = None,
                   retry: RetryPolicy | None = None) -> dict[str, Any]:
        """The config in force now, or at round `round_`: {"version", "config", ...}; with
        `participant_id` (speaking for it) also its inner steps for the round ("assignment")."""
        params: dict[str, Any] = {} if round_ is None else {"round": round_}
        if participant_id is None:
            return self._json("GET", "/v1/config", params=params, retry=retry)
        return self._json("GET", "/v1/config", params={**params, "participant_id": participant_id},
                          headers=self._as(participant_id), retry=retry)

    def change_config(self, changes: dict[str, Any], *, retry: RetryPolicy | None = None) -> dict[str, Any]:
        """Admin token: change the run config live (in force from the next round boundary)."""
        return self._json("PUT", "/v1/config", json={"changes": changes}, retry=retry)

    def validate_config(self, changes: dict[str, Any], *, retry: RetryPolicy | None = None) -> dict[str, Any]:
        """Admin token: dry run of a change: {"valid", "error", "diff"}; nothing is applied."""
        return self._json("POST", "/v1/config/validate", json={"changes": changes}, retry=retry)

    def config_history(self, limit: int = 50, *, retry: RetryPolicy | None = None) -> list[dict[str, Any]]:
        """Accepted config versions, newest first: version, created_at, author, diff, effective_round."""
        return self._json("GET", "/v1/config/history", params={"limit": limit}, retry=retry)["versions"]

    def kept_versions(self, *, retry: RetryPolicy | None = None) -> dict[str, Any]:
        """Admin: the kept versions a roll back can go to, newest first, and the committed version."""
        return self._json("GET", "/v1/admin/checkpoints", retry=retry)

    def roll_back(self, version: int, *, retry: RetryPolicy | None = None) -> dict[str, Any]:
        """Admin: put kept `version` back in force; answers the new version that holds it."""
        return self._json("POST", "/v1/admin/rollback", json={"version": version}, retry=retry)

    def mint_token(self, name: str, *, retry: RetryPolicy | None = None) -> dict[str, Any]:
        """Admin: a new participant token for site `name` (the answer is the one time it is shown)."""
        return self._json("POST", "/v1/admin/tokens", json={"name": name}, retry=retry)

    def list_tokens(self, *, retry: RetryPolicy | None = None) -> list[dict[str, Any]]:
        """Admin: the run's participant tokens (name, fingerprint, revoked, participants)."""
        return self._json("GET", "/v1/admin/tokens", retry=retry)["tokens"]

    def revoke_token(self, *, name: str | None = None, token_id: str | None = None,
                     participant_id: str | None = None, retry: RetryPolicy | None = None) -> dict[str, Any]:
        """Admin: revoke a participant token (by name, fingerprint, or a participant that used it)."""
        body = {k: v for k, v in {"name": name, "token_id": token_id, "participant_id": participant_id}.items()
                if v is not None}
        return self._json("POST", "/v1/admin/tokens/revoke", json=body, retry=retry)

    def evict(self, pid: str, *, retry: RetryPolicy | None = None) -> dict[str, Any]:
        """Admin: evict participant `pid` from the run."""
        return self._json("POST", f"/v1/participants/{pid}/evict", retry=retry)

    def events(self, stop: Callable[[], bool] | None = None) -> Iterator[tuple[str, Any]]:
        """Server-sent events of the run as (kind, data), one connection, no retry: the caller
        reconnects. Ends when the server closes the stream or `stop()` is true at an event."""
        with self._http.stream("GET", "/v1/stream", timeout=httpx.Timeout(5.0, read=60.0)) as r:
            if r.status_code >= 400:
                r.read()
                raise self._refusal(r, "GET /v1/stream")
            yield from sse_events(r.iter_lines(), stop)

    def status(self, *, retry: RetryPolicy | None = None) -> dict[str, Any]:
        return self._json("GET", "/v1/status", retry=retry)

    def recent_events(self, limit: int = 100, *, retry: RetryPolicy | None = None) -> list[dict[str, Any]]:
        """The run's last `limit` events (kind, message, ...), oldest first."""
        return self._json("GET", "/v1/events", params={"limit": limit}, retry=retry)["events"]

    def metrics(self, name: str | None = None, limit: int = 10000, *,
                retry: RetryPolicy | None = None) -> list[dict[str, Any]]:
        """Reported metrics, oldest first: participants' train loss and evals, the global evals."""
        params: dict[str, Any] = {"limit": limit}
        if name is not None:
            params["name"] = name
        return self._json("GET", "/v1/metrics", params=params, retry=retry)["metrics"]

    def heartbeat(self, pid: str, *, retry: RetryPolicy | None = None, **stats: Any) -> dict[str, Any]:
        return self._json("POST", f"/v1/participants/{pid}/heartbeat", json=stats, headers=self._as(pid),
                          retry=retry)

    def leave(self, pid: str, *, retry: RetryPolicy | None = None) -> dict[str, Any]:
        return self._json("POST", f"/v1/participants/{pid}/leave", headers=self._as(pid), retry=retry)

    def report(
        self, pid: str, values: dict[str, float], *, round_: int | None = None, step: int | None = None,
        retry: RetryPolicy | None = None,
    ) -> dict[str, Any]:
        return self._json(
            "POST", f"/v1/participants/{pid}/metrics", json={"round": round_, "step": step, "values": values},
            headers=self._as(pid), retry=retry,
        )

    def wait_round(self, round_: int, pid: str | None = None, wait_s: float = 25.0, *,
                   retry: RetryPolicy | None = None, piece: str | None = None) -> dict[str, Any]:
        """Round `round_`'s state, long-polled up to `wait_s` while it is open. With `pid` the
        answer says whether its update is in (`submitted`), or with `piece`, that piece of it:
        the poll returns at once when it is not, so that it is sent again."""
        params: dict[str, Any] = {"wait": wait_s}
        if pid is not None:
            params["participant_id"] = pid
        if piece is not None:
            params["piece"] = piece
        return self._json("GET", f"/v1/rounds/{round_}", params=params, headers=self._as(pid), retry=retry)

    def download(
        self,
        *,
        version: int | None = None,
        pid: str | None = None,
        allocate: Callable[[TensorSpec], torch.Tensor] | None = None,
        on_header: Callable[[dict[str, TensorSpec], dict[str, str]], None] | None = None,
        retry: RetryPolicy | None = None,
        rows: Mapping[str, Sequence[int] | None] | None = None,
        stall_timeout_s: float | None = None,
        streams: int | Literal["auto"] = 1,
        delta_from: int | None = None,
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Stream the global model; returns (version, tensors). Each tensor is read straight
        into the storage `allocate` gives (e.g. a parameter), one copy per byte. With `rows`
        (tensor name -> its [start, stop) rows along dimension 0, or None: whole), only those
        tensors come, each only those rows (a rank's shard: docs/training-jobs.md). A broken
        attempt is resumed by the next from where it stopped (`transport.resume`); a connection
        silent for `stall_timeout_s` (default: the read timeout) counts as broken. `streams` > 1:
        byte ranges of the body over that many connections at once (`transport.parallel`; fast
        IO's direct path only, else one); "auto": as many as paid on this client's last
        downloads (`parallel.StreamChooser`). `delta_from`: instead, the newest version as the
        compressed delta from that version (`GET /v1/model/delta`, one stream; `wire/delta.py`
        applies it); a CoordinatorError 404 no_delta or 409 delta_unavailable when there is none."""
        params: dict[str, Any] = {}
        path = "/v1/model"
        if delta_from is not None:
            path, streams, params["from"] = "/v1/model/delta", 1, delta_from
        if version is not None:
            params["version"] = version
        if pid is not None:
            params["participant_id"] = pid
        if rows is not None:
            params["rows"] = json.dumps({n: None if r is None else list(r) for n, r in rows.items()},
                                        separators=(",", ":"))
        read_s = self._timeouts.read if stall_timeout_s is None else stall_timeout_s
        what = "download of the global model" + ("" if version is None else f" version {version}") + (
            "" if delta_from is None else f" as the delta from version {delta_from}")
        partial = PartialDownload(what, allocate, on_header, log)

        p = self._streams.choose() if streams == "auto" else streams
        t0 = time.monotonic()

        def once() -> tuple[int, dict[str, torch.Tensor]]:
            if p > 1 and is_direct(self.url):
                return self._download_parallel(params, pid, p, allocate, on_header, what, read_s)
            headers = {**self._as(pid), **partial.headers()}
            try:
                if is_direct(self.url):
                    return self._download_direct(path, params, headers, partial, read_s)
                return self._download_httpx(path, params, headers, partial, read_s)
            except BaseException:
                partial.failed()
                raise

        try:
            got: tuple[int, dict[str, torch.Tensor]] = self._call(what, once, retry=retry)
        finally:
            partial.close()
        if streams == "auto" and is_direct(self.url):
            self._streams.record(p, sum(t.numel() * t.element_size() for t in got[1].values()),
                                 time.monotonic() - t0)
        return got

    def _download_httpx(self, path: str, params: dict[str, Any], headers: dict[str, str], partial: PartialDownload,
                        read_s: float) -> tuple[int, dict[str, torch.Tensor]]:
        """One attempt of `download` through httpx (the plain path)."""
        timeout = dataclasses.replace(self._timeouts, read=read_s).httpx()
        with self._http.stream("GET", path, params=params, headers=headers, timeout=timeout) as r:
            if r.status_code >= 400:
                r.read()
                raise self._refusal(r, f"GET {path}")
            body = partial.start(r.status_code, r.headers)
            # No chunk size: httpx would re-chunk through a BytesIO (three more copies
            # per byte); a socket read is at most httpcore's read size (see `tune_httpcore`).
            for chunk in r.iter_raw():
                body.feed(chunk)
            return partial.finish()

    def _download_parallel(self, params: dict[str, Any], pid: str | None, streams: int,
                           allocate: Callable[[TensorSpec], torch.Tensor] | None,
                           on_header: Callable[[dict[str, TensorSpec], dict[str, str]], None] | None,
                           what: str, read_s: float) -> tuple[int, dict[str, torch.Tensor]]:
        """One attempt of `download` as byte ranges over `streams` direct connections."""
        def request(fields: dict[str, str]) -> Any:
            headers = {"Authorization": f"Bearer {self._token}", "User-Agent": "fedtrain-participant",
                       **self._as(pid), **fields}
            return direct_request("GET", self.url, "/v1/model", params, headers, connect_timeout=self._timeouts.connect,
                                  read_timeout=read_s, tls=self._direct_tls)

        def refuse(r: Any) -> Exception:
            return self._refusal(r.as_httpx(), "GET /v1/model")

        return ParallelDownload(request, streams, allocate, on_header, what, refuse, log).run()

    def _download_direct(self, path: str, params: dict[str, Any], headers: dict[str, str],
                         partial: PartialDownload, read_s: float) -> tuple[int, dict[str, torch.Tensor]]:
        """`download` over `fetch.direct_request`: socket reads land in the tensors' storage."""
        fields = {"Authorization": f"Bearer {self._token}", "User-Agent": "fedtrain-participant", **headers}
        with direct_request("GET", self.url, path, params, fields, connect_timeout=self._timeouts.connect,
                            read_timeout=read_s, tls=self._direct_tls) as r:
            if r.status >= 400:
                raise self._refusal(r.as_httpx(), f"GET {path}")
            partial.start(r.status, r.headers).read_into(r)
            return partial.finish()
