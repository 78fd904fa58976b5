"""A participant's uploads: one pseudo-gradient (or a piece of one), whole or as parts that a
retry resumes (`upload_parts.py`); a silent connection given up after `transfer.stall_timeout_s`
and retried soon, the coordinator closing the older (the newer attempt takes over); a refusal
read before a body is sent again. A mixin of `CoordinatorClient`, which holds the connection,
the retry loop and the errors. No torch at module level.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import httpx

from fedtrain.errors import CoordinatorError
from fedtrain.participant.client.retry import RetryPolicy, Timeouts
from fedtrain.participant.client.upload_parts import WHOLE_DIGEST_HEADER, BodyParts, CountedProgress, send_parts
from fedtrain.transport.direct_http import direct_request, is_direct

if TYPE_CHECKING:
    import ssl

    from fedtrain.config import TransferConfig
    from fedtrain.transport.progress import Progress
    from fedtrain.wire.encode import EncodedBody

__all__ = ["KEY_HEADER", "PART_RETRY", "RESEND_BACKOFF_S", "UploadCalls"]

log = logging.getLogger("fedtrain.participant")

KEY_HEADER = "X-Fedtrain-Participant-Key"  # the coordinator's `auth.KEY_HEADER`
RESEND_BACKOFF_S = 1.0  # the longest wait before an upload is sent again (a link that is down comes back)
#: Refusals of a part that sending it again mends: its bytes were damaged on the way, or the
#: upload it was part of was replaced (by our own newer attempt) while it streamed in.
PART_RETRY = frozenset({"part_digest_mismatch", "upload_replaced", "taken_over", "parts_pending"})


class UploadCalls:
    """The upload calls of `CoordinatorClient` (what they use of it is declared below)."""

    if TYPE_CHECKING:
        url: str
        retry: RetryPolicy
        _token: str
        _timeouts: Timeouts
        _http: httpx.Client

        @property
        def _direct_tls(self) -> ssl.SSLContext: ...

        def _call(self, what: str, fn: Callable[[], Any], also_retry: frozenset[str] = frozenset(),
                  retry: RetryPolicy | None = None) -> Any: ...

        def _as(self, pid: str | None) -> dict[str, str]: ...

        def _answer(self, response: httpx.Response, where: str) -> Any: ...

    def upload(self, round_: int, pid: str, body: EncodedBody, tokens: int, *,
               retry: RetryPolicy | None = None, piece: str | None = None,
               transfer: TransferConfig | None = None, progress: Progress | None = None) -> dict[str, Any]:
        """PUT one pseudo-gradient; RoundClosedError (409) when the round is already over.
        `piece`: the body is that piece of the update (its metadata names its rows).
        `transfer` (the run config's): a body larger than `part_mb` travels as parts, which a
        retry resumes; a connection that moves no byte for `stall_timeout_s` is given up and
        the upload tried again soon (the coordinator closes the older connection: the newer
        attempt takes over). `progress` counts the bytes handed to the connections."""
        from fedtrain.wire.digest import DIGEST_HEADER

        counted = CountedProgress(progress)
        stall_s = transfer.stall_timeout_s if transfer is not None else None
        policy = retry or self.retry
        if transfer is not None:  # a link that is down is tried again soon, not after a long backoff
            policy = dataclasses.replace(policy, max_backoff_s=min(policy.max_backoff_s, RESEND_BACKOFF_S))
        part_bytes = transfer.part_mb << 20 if transfer is not None else None
        if part_bytes is not None and body.content_length > part_bytes:
            assert transfer is not None
            return self._upload_parts(round_, pid, BodyParts(body, part_bytes), tokens, piece,
                                      transfer.streams, stall_s, policy, counted)
        path = f"/v1/rounds/{round_}/updates/{pid}"
        headers = {
            DIGEST_HEADER: body.digest(),
            "Content-Length": str(body.content_length),
            "Content-Type": "application/octet-stream",
            **self._as(pid),
        }

        params: dict[str, Any] = {"tokens": tokens} if piece is None else {"tokens": tokens, "piece": piece}
        attempts = 0

        def once() -> Any:
            nonlocal attempts
            if attempts:  # a retry: an earlier attempt may have got in (its answer lost)
                done = self._already_in(round_, pid, piece, stall_s)
                if done is not None:
                    return done
            attempts += 1
            return self._put(path, params, headers, counted.counting(iter(body)), stall_s)

        return self._call(f"upload of round {round_}", once, retry=policy)

    def _put(self, path: str, params: dict[str, Any], headers: dict[str, str], chunks: Iterator[memoryview],
             stall_s: float | None, answer_s: float | None = None) -> Any:
        """One PUT of `chunks`; a connection that takes no byte of them for `stall_s` is given
        up, and one whose answer is silent for `answer_s` (default: the read timeout)."""
        read_s = answer_s if answer_s is not None else self._timeouts.read
        if is_direct(self.url):
            fields = {**headers, "Authorization": f"Bearer {self._token}", "User-Agent": "fedtrain-participant"}
            with direct_request("PUT", self.url, path, params, fields, body=chunks,
                                connect_timeout=self._timeouts.connect, read_timeout=read_s,
                                write_timeout=stall_s if stall_s is not None else self._timeouts.write,
                                tls=self._direct_tls) as r:
                answer = r.as_httpx()
            return self._answer(answer, f"PUT {path}")
        timeout = self._timeouts.httpx() if stall_s is None else httpx.Timeout(
            connect=self._timeouts.connect, read=read_s, write=stall_s, pool=self._timeouts.pool)
        response = self._http.put(path, params=params, content=chunks, headers=headers,  # type: ignore[arg-type]
                                  timeout=timeout)
        return self._answer(response, f"PUT {path}")

    def _asking(self, stall_s: float | None) -> httpx.Timeout:
        """The timeouts of a small question asked between the attempts of an upload: one whose
        answer is silent for `stall_s` is given up like the upload's connection."""
        if stall_s is None:
            return self._timeouts.httpx()
        return httpx.Timeout(connect=self._timeouts.connect, read=stall_s, write=stall_s, pool=self._timeouts.pool)

    def _already_in(self, round_: int, pid: str, piece: str | None,
                    stall_s: float | None = None) -> dict[str, Any] | None:
        """Before a body is sent again: the answer of an upload that is in already (an earlier
        attempt got in, its answer lost), so nothing is sent; None: send it. An earlier attempt
        still streaming on a silent connection does not hold the retry up: the coordinator
        closes it when the retry comes (the newer attempt takes over)."""
        params: dict[str, Any] = {"participant_id": pid} if piece is None else {"participant_id": pid, "piece": piece}
        where = f"GET /v1/rounds/{round_}"
        try:
            info = self._answer(self._http.get(f"/v1/rounds/{round_}", params=params, headers=self._as(pid),
                                               timeout=self._asking(stall_s)), where)
        except CoordinatorError:
            return None  # the upload itself gets the refusal that says why (round not open, ...)
        if isinstance(info, dict) and info.get("submitted") is True:
            return {"accepted": True, "duplicate": True, "round": round_, **({"piece": piece} if piece else {})}
        return None

    def upload_parts_held(self, round_: int, pid: str, piece: str | None = None, *,
                          retry: RetryPolicy | None = None) -> dict[str, Any] | None:
        """Which parts of our upload in parts for `round_` the coordinator holds ({"digest",
        "held", "missing", ...}); None when it holds none (no upload session)."""
        return self._call(f"GET parts of round {round_}", lambda: self._parts_held(round_, pid, piece), retry=retry)

    def _parts_held(self, round_: int, pid: str, piece: str | None,
                    stall_s: float | None = None) -> dict[str, Any] | None:
        """`upload_parts_held`, once (a transport error is raised: the caller's retry loop has it)."""
        path = f"/v1/rounds/{round_}/updates/{pid}/parts"
        params = {"piece": piece} if piece is not None else {}
        try:
            answer: dict[str, Any] = self._answer(self._http.get(path, params=params, headers=self._as(pid),
                                                                 timeout=self._asking(stall_s)), f"GET {path}")
        except CoordinatorError as e:
            if e.code == "no_upload_session":
                return None
            raise
        return answer

    def _upload_parts(self, round_: int, pid: str, parts: BodyParts, tokens: int, piece: str | None,
                      streams: int | str, stall_s: float | None, policy: RetryPolicy,
                      counted: CountedProgress) -> Any:
        """`upload` of a body larger than one part: the parts the coordinator does not hold, up
        to `streams` at once; each retry asks which it holds and sends only the rest."""
        from fedtrain.wire.digest import DIGEST_HEADER

        path = f"/v1/rounds/{round_}/updates/{pid}"
        whole = parts.body.digest()
        base: dict[str, Any] = {"tokens": tokens, "total": parts.total, "part_bytes": parts.part_bytes,
                                **({"piece": piece} if piece is not None else {})}

        def send(index: int, written: Callable[[], None]) -> dict[str, Any]:
            start, stop = parts.span(index)
            headers = {DIGEST_HEADER: parts.digest(index), WHOLE_DIGEST_HEADER: whole,
                       "Content-Length": str(stop - start), "Content-Type": "application/octet-stream", **self._as(pid)}
            # A part's answer comes as soon as its bytes are in (the one that completes the body
            # waits for its placement: if that takes longer, the retry finds every part in and
            # asks again until the update is placed), so a silent answer is a silent link too.
            answer: dict[str, Any] = self._put(path, {**base, "part": index}, headers,
                                               counted.counting(parts.chunks(index), written), stall_s, stall_s)
            return answer

        def once() -> Any:
            # Every attempt asks first (two small GETs; an earlier sync attempt of this round
            # may have sent parts already): only the parts the coordinator does not hold go.
            todo = list(range(parts.count))
            done = self._already_in(round_, pid, piece, stall_s)
            if done is not None:
                return done
            held = self._parts_held(round_, pid, piece, stall_s)
            if held is not None and held.get("digest") == whole and held.get("total") == parts.total \
                    and held.get("part_bytes") == parts.part_bytes:
                have = set(held.get("held", []))
                todo = [i for i in todo if i not in have]
                log.info("upload of round %d resumes: %d of %d parts are in, %d to send", round_, len(have),
                         parts.count, len(todo))
            final = send_parts(parts, todo, streams, send, log)
            if final is None:  # every part is in, yet none completed the body (it was being placed): ask again
                raise CoordinatorError("the upload's parts are in but its answer is not: asking again", status=503,
                                       code="parts_pending", details={"retry_after_s": RESEND_BACKOFF_S})
            return final

        return self._call(f"upload of round {round_} in {parts.count} parts", once, retry=policy,
                          also_retry=PART_RETRY)
