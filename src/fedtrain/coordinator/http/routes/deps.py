"""What every router of the coordinator shares: the service, who is asking, and the
server's streaming hooks.

The service is the one `create_app` put in `app.state`: a route reaches it through the
dependency `coordinator`, never through a global or a closure.

More: docs/architecture.md, "coordinator/http/routes/deps.py".
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Header, Path, Query, Request
from pydantic import ConfigDict

from fedtrain.coordinator.members.auth import KEY_HEADER, Identity, key_cookie, role_check
from fedtrain.coordinator.service import Coordinator
from fedtrain.errors import Refused
from fedtrain.transport import READINTO, SEND, Body, ResponseSink
from fedtrain.transport.ranges import MAX_RANGE_CHARS

#: The largest round, version or step a request may name (beyond: 422). Below 2^53, so that a
#: number is exact as a JSON client's double, and 1,024 of them summed still fit SQLite's
#: 64-bit integers.
MAX_COUNT = 2**53 - 1
#: The largest token count an upload may claim (beyond: 422): a claim counts as at most the
#: round's schedule (`policy.count_tokens`) before anything sums it.
MAX_TOKEN_CLAIM = 2**62
#: The config of every request body's model: no field it does not name, and JSON types as the
#: schema says them (strict: `false` or "5" is no integer; lax pydantic took `false` for 0).
BODY = ConfigDict(extra="forbid", strict=True)
#: A participant id (its name: `members/roster.py` refuses others at join with 400 invalid_name).
PID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
#: The longest `?token=` of an event stream (tokens of the run are far shorter).
MAX_TOKEN_CHARS = 512

Pid = Annotated[str, Path(min_length=1, max_length=64, pattern=PID_PATTERN, description="A participant id.")]
PidQuery = Annotated[str | None, Query(min_length=1, max_length=64, pattern=PID_PATTERN,
                                       description="A participant this request speaks for (its key).")]
StreamToken = Annotated[str | None, Query(max_length=MAX_TOKEN_CHARS, description="for EventSource")]
#: The request headers of a resumable download (`transport/ranges.py`), the same on every route that serves one.
RangeHeader = Annotated[str | None, Header(alias="Range", max_length=MAX_RANGE_CHARS, description="one byte range: "
                                           "bytes=<first>-<last>, bytes=<first>- or bytes=-<n>")]
IfRangeHeader = Annotated[str | None, Header(alias="If-Range", max_length=MAX_RANGE_CHARS,
                                             description="the ETag the range belongs to: another one gets the "
                                             "whole body")]
IfMatchHeader = Annotated[str | None, Header(alias="If-Match", max_length=MAX_RANGE_CHARS,
                                             description="ETags: a body with another one is refused (412)")]
#: The longest participant key header (`X-Fedtrain-Participant-Key`; the keys made are 46 characters).
MAX_KEY_CHARS = 256
ParticipantKey = Annotated[str | None, Header(alias=KEY_HEADER, max_length=MAX_KEY_CHARS,
                                              description="The participant key its join answered with "
                                              "(else the cookie `fedtrain-key-<id>`).")]
Round = Annotated[int, Path(ge=0, le=MAX_COUNT, description="A round (asynchronous mode: the version the update "
                            "was trained from), 0 to 2^53-1.")]


def service_of(request: Request) -> Coordinator:
    """The service of the app that serves `request`."""
    service: Coordinator = request.app.state.service
    return service


async def coordinator(request: Request) -> Coordinator:
    """The dependency that hands a route its service (async: no trip through the thread pool)."""
    return service_of(request)


def authenticate(request: Request, authorization: str | None) -> Identity:
    """The identity behind an `Authorization` value; a 401 when there is none."""
    tokens = service_of(request).tokens
    ident = tokens.identify(authorization)
    if ident is None:
        raise Refused(401, *tokens.refusal(authorization))
    return ident


@role_check
def identity(request: Request) -> Identity:
    """The identity of the bearer token of the request."""
    return authenticate(request, request.headers.get("authorization"))


def _act_as(request: Request, ident: Identity, pid: str, key: str | None) -> Identity:
    """Refuse a request that speaks for participant `pid` without its participant key (`key`:
    the header's, else the cookie's)."""
    key = key or request.cookies.get(key_cookie(pid))
    service_of(request).act_as(ident, pid, key)
    return ident


@role_check
def speaker(pid: Pid, request: Request, key: ParticipantKey = None) -> Identity:
    """The identity of a request that speaks for the participant of its path."""
    return _act_as(request, identity(request), pid, key)


@role_check
def speaker_by_query(request: Request, participant_id: PidQuery = None, key: ParticipantKey = None) -> Identity:
    """The identity of a request that may speak for a participant (`participant_id`)."""
    ident = identity(request)
    return _act_as(request, ident, participant_id, key) if participant_id is not None else ident


@role_check
def stream_identity(request: Request, token: StreamToken = None) -> Identity:
    """The identity of an event stream: the bearer token, else `?token=` (EventSource sends no headers)."""
    if token and not request.headers.get("authorization"):
        return authenticate(request, f"Bearer {token}")  # a revoked one is `token_revoked` here too
    return identity(request)


def response_sink(request: Request) -> ResponseSink | None:
    """The server's sink for the answer to `request` (`fedtrain.transport.ResponseSink`), if it has one."""
    sink: ResponseSink | None = request.scope.get("extensions", {}).get(SEND)
    return sink


def upload_body(request: Request) -> Body:
    """The body of `request` as a stream, read straight into buffers where the server can."""
    return Body(request.stream(), request.scope.get("extensions", {}).get(READINTO))
