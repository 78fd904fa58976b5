"""What every router of the coordinator shares: the service, who is asking, and the
server's streaming hooks.

The service is the one `create_app` put in `app.state`: a route reaches it through the
dependency `coordinator`, never through a global or a closure.

More: docs/architecture.md, "coordinator/http/routes/deps.py".
"""

from __future__ import annotations

from fastapi import Query, Request

from fedtrain.coordinator.members.auth import KEY_HEADER, Identity, key_cookie, role_check
from fedtrain.coordinator.service import Coordinator
from fedtrain.errors import Refused
from fedtrain.transport import READINTO, SEND, Body, ResponseSink

MAX_COUNT = 2**62  # counts beyond this are refused with 422 (SQLite stores 64-bit integers)


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


def _act_as(request: Request, ident: Identity, pid: str) -> Identity:
    """Refuse a request that speaks for participant `pid` without its participant key."""
    key = request.headers.get(KEY_HEADER) or request.cookies.get(key_cookie(pid))
    service_of(request).act_as(ident, pid, key)
    return ident


@role_check
def speaker(pid: str, request: Request) -> Identity:
    """The identity of a request that speaks for the participant of its path."""
    return _act_as(request, identity(request), pid)


@role_check
def speaker_by_query(request: Request, participant_id: str | None = None) -> Identity:
    """The identity of a request that may speak for a participant (`participant_id`)."""
    ident = identity(request)
    return _act_as(request, ident, participant_id) if participant_id is not None else ident


@role_check
def stream_identity(request: Request, token: str | None = Query(None, description="for EventSource")) -> Identity:
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
