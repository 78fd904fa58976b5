"""HTTP routes of the coordinator (versioned under /v1): parse, authorize, call the service.

Every error leaves here in the one JSON shape of `fedtrain.errors.error_body` (with a
Retry-After header when its details name `retry_after_s`). Tensor bodies stream in both
directions; nothing here buffers a whole body.

A route that speaks for a participant (`{pid}` in its path, or `participant_id` in its
query) authorizes with the dependency `speaker` or `speaker_by_query`: the token, then the
participant key of the header `X-Fedtrain-Participant-Key`, else of the cookie its join
answer set (`auth.py`, `Coordinator.act_as`); as a dependency, before its body is read.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import fedtrain
from fedtrain.config import MB
from fedtrain.coordinator import dashboard, storage
from fedtrain.coordinator.auth import KEY_HEADER, Identity, key_cookie, role_check
from fedtrain.coordinator.broadcast import sse
from fedtrain.coordinator.limits import BodyLimit, InFlight
from fedtrain.coordinator.publish import ModelResponse
from fedtrain.coordinator.service import Coordinator, Refused
from fedtrain.coordinator.storage import storage_full
from fedtrain.errors import (
    ConfigError,
    FedtrainError,
    MergeError,
    StateError,
    WireError,
    error_body,
)
from fedtrain.transport import READINTO, SEND, Body
from fedtrain.wire import DIGEST_HEADER

log = logging.getLogger("fedtrain.coordinator")

VERSION_HEADER = "X-Fedtrain-Version"
STREAM_KEEPALIVE_S = 15.0
STREAM_SEND_BUFFER = 64 << 10  # kernel bytes an event stream may have unsent (`ResponseSink.limit_kernel_buffer`)
UPLOAD_RETRY_AFTER_S = 1.0  # what a 429 upload_in_progress asks the client to wait


class JoinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, description="Stable participant name; rejoining with it resumes the identity.")
    info: dict[str, Any] = Field(default_factory=dict, description="Free-form facts (host, world size, ...).")
    key_cookie: bool = Field(True, description="Also set the participant key as a cookie (`fedtrain-key-<id>`), "
                             "for HTTP clients with a cookie jar; a client that sends the key header itself "
                             "says false (a Set-Cookie would show the key in its HTTP debug logs).")


MAX_COUNT = 2**62  # counts beyond this are refused with 422 (SQLite stores 64-bit integers)


class HeartbeatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int = Field(0, ge=0, le=MAX_COUNT)
    round: int = Field(0, ge=0, le=MAX_COUNT)
    loss: float | None = Field(None, allow_inf_nan=False)
    tokens_per_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    config_version: int | None = Field(None, ge=1, description="The config version the participant runs.")


class ConfigChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    changes: dict[str, Any] = Field(..., description="Fields to change, nested like the config (a merge patch).")


class RevokeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token_id: str | None = Field(None, max_length=64, description="Fingerprint of the token (GET /v1/admin/tokens).")
    participant_id: str | None = Field(None, max_length=64, description="Revoke the token this participant used.")


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(..., ge=0, le=MAX_COUNT, description="A kept version (GET /v1/admin/checkpoints).")


class MetricsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    round: int | None = Field(None, ge=0, le=MAX_COUNT)
    step: int | None = Field(None, ge=0, le=MAX_COUNT)
    values: dict[str, float] = Field(..., description="Metric name to finite value.")


def _status_of(exc: FedtrainError) -> int:
    if isinstance(exc, Refused):
        return exc.status
    if isinstance(exc, WireError):
        return 400
    if isinstance(exc, (MergeError, ConfigError)):
        return 422
    if isinstance(exc, StateError):
        return 500
    return 400


def create_app(service: Coordinator) -> FastAPI:
    """The FastAPI application around an opened `Coordinator`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        yield
        await service.stop()

    app = FastAPI(
        title="fedtrain coordinator",
        version=fedtrain.__version__,
        openapi_url="/v1/openapi.json",
        docs_url="/v1/docs",
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.service = service

    @app.exception_handler(FedtrainError)
    async def _fedtrain_error(request: Request, exc: FedtrainError) -> JSONResponse:
        status = _status_of(exc)
        code = getattr(exc, "code", "error")
        headers = {"Retry-After": str(storage.RETRY_AFTER_S)} if status == 507 else None
        wait = exc.details.get("retry_after_s")
        if isinstance(wait, (int, float)):  # name_in_use, upload_in_progress, evicted_recently
            headers = {"Retry-After": str(max(1, math.ceil(wait)))}
        return JSONResponse(error_body(status, code, exc.message, exc.details), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
        return JSONResponse(error_body(422, "invalid_request", f"invalid request: {problems}"), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(exc.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            error_body(exc.status_code, code, message),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        if storage_full(exc):  # the operator's to fix, and the client's to retry: not an internal error
            log.warning("%s %s: %s (%s)", request.method, request.url.path, storage.MESSAGE, exc)
            return JSONResponse(error_body(507, "insufficient_storage", storage.MESSAGE), status_code=507,
                                headers={"Retry-After": str(storage.RETRY_AFTER_S)})
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body(500, "internal", "internal error in the coordinator; its log has the details"),
            status_code=500,
        )

    def authenticate(authorization: str | None) -> Identity:
        ident = service.tokens.identify(authorization)
        if ident is None:
            raise Refused(401, *service.tokens.refusal(authorization))
        return ident

    @role_check
    def identity(request: Request) -> Identity:
        return authenticate(request.headers.get("authorization"))

    def act_as(request: Request, ident: Identity, pid: str) -> Identity:
        """Refuse a request that speaks for participant `pid` without its participant key."""
        service.act_as(ident, pid, request.headers.get(KEY_HEADER) or request.cookies.get(key_cookie(pid)))
        return ident

    @role_check
    def speaker(pid: str, request: Request) -> Identity:
        """The identity of a request that speaks for the participant of its path."""
        return act_as(request, identity(request), pid)

    @role_check
    def speaker_by_query(request: Request, participant_id: str | None = None) -> Identity:
        """The identity of a request that may speak for a participant (`participant_id`)."""
        ident = identity(request)
        return act_as(request, ident, participant_id) if participant_id is not None else ident

    dashboard.add_routes(app, service, identity)  # /, /static, /v1 (JSON index), /v1/whoami, /metrics

    app.add_middleware(BodyLimit, upload_limit=lambda: int(service.config.max_upload_mb * MB))  # type: ignore[arg-type]
    uploads_in_flight = InFlight()  # one upload at a time per (participant, round)

    @app.get("/v1/admin/tokens", summary="Admin: participant tokens by fingerprint, revoked or not, who used each")
    async def list_tokens(ident: Identity = Depends(identity)) -> dict[str, Any]:
        return service.token_view(ident)

    @app.post("/v1/admin/tokens/revoke", summary="Admin: revoke a participant token; its participants are evicted")
    async def revoke_token(body: RevokeRequest, ident: Identity = Depends(identity)) -> dict[str, Any]:
        return service.revoke_token(ident, body.token_id, body.participant_id)

    @app.get("/v1/healthz", summary="Liveness (no token needed)")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "current_round": service.version}

    @app.post("/v1/join", summary="Join the run: participant id and key, run config, current round, model spec")
    async def join(body: JoinRequest, request: Request, response: Response,
                   ident: Identity = Depends(identity)) -> dict[str, Any]:
        key = request.headers.get(KEY_HEADER) or (request.cookies.get(key_cookie(body.name)) if body.name else None)
        answer = service.join(ident, body.name, body.info, key)
        if body.key_cookie:
            response.set_cookie(key_cookie(answer["participant_id"]), answer["participant_key"], path="/v1",
                                httponly=True, samesite="strict", secure=request.url.scheme == "https")
        return answer

    @app.post("/v1/participants/{pid}/heartbeat", summary="Heartbeat with progress")
    async def heartbeat(pid: str, body: HeartbeatRequest, ident: Identity = Depends(speaker)) -> dict[str, Any]:
        return service.heartbeat(ident, pid, body.model_dump())

    @app.post("/v1/participants/{pid}/leave", summary="Leave the run")
    async def leave(pid: str, ident: Identity = Depends(speaker)) -> dict[str, Any]:
        return service.leave(ident, pid)

    @app.post("/v1/participants/{pid}/metrics", summary="Report metrics (losses, evals)")
    async def metrics(pid: str, body: MetricsRequest, ident: Identity = Depends(speaker)) -> dict[str, Any]:
        bad = [k for k, v in body.values.items() if v != v or v in (float("inf"), float("-inf"))]
        if bad:
            raise Refused(422, "non_finite", f"metric values must be finite: {', '.join(bad)}")
        service.add_metrics(ident, pid, body.round, body.step, body.values)
        return {"stored": len(body.values)}

    @app.get("/v1/config", summary="The config in force (now, or at `round`) and its version")
    async def get_config(
        round: int | None = Query(None, ge=0, le=MAX_COUNT), ident: Identity = Depends(identity)
    ) -> dict[str, Any]:
        return service.config_view(round)

    @app.put("/v1/config", summary="Admin: change the config live; in force from the next round boundary")
    async def put_config(body: ConfigChange, ident: Identity = Depends(identity)) -> dict[str, Any]:
        return service.change_config(ident, body.changes)

    @app.post("/v1/config/validate", summary="Admin: check a change without applying it")
    async def validate_config(body: ConfigChange, ident: Identity = Depends(identity)) -> dict[str, Any]:
        return service.validate_config(ident, body.changes)

    @app.get("/v1/config/history", summary="Accepted config versions: when, by whom, the diff")
    async def config_history(
        limit: int = Query(50, ge=1, le=1000), ident: Identity = Depends(identity)
    ) -> dict[str, Any]:
        return {"versions": service.store.config_history(limit)}

    @app.get("/v1/admin/checkpoints", summary="Admin: the kept versions a roll back can go to")
    async def kept_versions(ident: Identity = Depends(identity)) -> dict[str, Any]:
        return service.kept_versions(ident)

    @app.post("/v1/admin/rollback", summary="Admin: put a kept version back in force as the next version")
    async def rollback(body: RollbackRequest, ident: Identity = Depends(identity)) -> dict[str, Any]:
        return await service.roll_back_to(ident, body.version)

    @app.post("/v1/participants/{pid}/evict", summary="Admin: evict a participant")
    async def evict(pid: str, ident: Identity = Depends(identity)) -> dict[str, Any]:
        return service.evict(ident, pid)

    @role_check
    def stream_identity(request: Request, token: str | None = Query(None, description="for EventSource")) -> Identity:
        if token and not request.headers.get("authorization"):
            return authenticate(f"Bearer {token}")  # a revoked one is `token_revoked` here too
        return identity(request)

    @app.get("/v1/stream", summary="Server-sent events: config changes, run events, status updates",
             responses={200: {"content": {"text/event-stream": {}}}})
    async def stream(request: Request, ident: Identity = Depends(stream_identity)) -> StreamingResponse:
        subscription = service.broadcast.subscribe()
        sink = request.scope.get("extensions", {}).get(SEND)
        if sink is not None:  # a subscriber that stops reading is seen at once, not after megabytes
            sink.limit_kernel_buffer(STREAM_SEND_BUFFER)

        async def events() -> AsyncIterator[str]:
            try:
                yield sse("hello", {"config": service.config_view(None), "status": service.status()})
                async for text in subscription.events(STREAM_KEEPALIVE_S, service.status):
                    yield text  # a status is built once per change, whatever the number of subscribers
            finally:
                subscription.close()

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @app.get("/v1/status", summary="Run state: rounds, participants, bytes")
    async def status(ident: Identity = Depends(identity)) -> dict[str, Any]:
        return service.status()

    @app.get("/v1/events", summary="Recent events of the run")
    async def events(limit: int = Query(100, ge=1, le=10000), ident: Identity = Depends(identity)) -> dict[str, Any]:
        return {"events": service.store.events(limit)}

    @app.get("/v1/metrics", summary="Reported metrics")
    async def get_metrics(
        name: str | None = None, limit: int = Query(10000, ge=1, le=100000), ident: Identity = Depends(identity)
    ) -> dict[str, Any]:
        return {"metrics": service.store.metrics(name, limit)}

    @app.get("/v1/rounds/{round_}", summary="Round status; long-polls up to `wait` seconds while it is open")
    async def round_status(
        round_: int,
        wait: float = Query(0.0, ge=0, le=60),
        participant_id: str | None = None,
        ident: Identity = Depends(speaker_by_query),
    ) -> dict[str, Any]:
        return await service.wait_round(ident, participant_id, round_, wait)

    @app.put(
        "/v1/rounds/{round_}/updates/{pid}",
        summary="Upload a pseudo-gradient (safetensors body) for a round; idempotent per (round, participant)",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            }
        },
    )
    async def upload(
        round_: int,
        pid: str,
        request: Request,
        tokens: int = Query(..., ge=0, le=MAX_COUNT),
        ident: Identity = Depends(speaker),
    ) -> dict[str, Any]:
        digest = request.headers.get(DIGEST_HEADER)
        if not digest:
            raise Refused(400, "digest_required",
                          f"uploads need a {DIGEST_HEADER} header (xxh3-128:<hex> or sha256:<hex> of the body)")
        length_header = request.headers.get("content-length")
        try:
            length = int(length_header) if length_header is not None else None
        except ValueError:
            raise Refused(400, "invalid_length", "Content-Length is not a number") from None
        if not uploads_in_flight.take((pid, round_)):
            raise Refused(429, "upload_in_progress", f"an upload of {pid} for round {round_} is in progress on another "
                          "connection; send again once it is over",
                          {"round": round_, "retry_after_s": UPLOAD_RETRY_AFTER_S})
        try:
            body = Body(request.stream(), request.scope.get("extensions", {}).get(READINTO))
            return await service.receive_update(ident, pid, round_, tokens, digest, length, body)
        except ClientDisconnect:
            raise Refused(400, "client_disconnected", "the upload ended before the body was complete") from None
        finally:
            uploads_in_flight.give_back((pid, round_))

    @app.get(
        "/v1/model",
        summary="Download the global model (safetensors stream)",
        responses={200: {"content": {"application/octet-stream": {}}}},
    )
    async def model(
        version: int | None = Query(None, ge=0, le=MAX_COUNT),
        participant_id: str | None = None,  # counted as its download: only by itself (`speaker_by_query`)
        ident: Identity = Depends(speaker_by_query),
    ) -> StreamingResponse:
        stream = service.model_stream(version, participant_id)
        headers = {
            "Content-Length": str(stream.size), DIGEST_HEADER: stream.digest, VERSION_HEADER: str(stream.version)
        }
        return ModelResponse(stream, headers)

    return app
