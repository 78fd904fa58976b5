"""The coordinator's FastAPI application: the routers of `routes/` put together, with the
error handlers, the body limit and the service's lifespan.

The routes parse, authorize and call the service (`routes/`); this module holds what spans
them all. Every error leaves here in the one JSON shape of `fedtrain.errors.error_body`
(with a Retry-After header when its details name `retry_after_s`, or the disk is full).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

import fedtrain
from fedtrain.config import MB
from fedtrain.coordinator.http.dashboard import STATIC_DIR
from fedtrain.coordinator.http.limits import BodyLimit, UploadsInFlight
from fedtrain.coordinator.http.routes import (
    admin,
    live_config,
    membership,
    model_delta,
    observability,
    round_traffic,
    secagg,
    web,
)
from fedtrain.coordinator.service import Coordinator
from fedtrain.coordinator.state import storage
from fedtrain.coordinator.state.storage import storage_full
from fedtrain.errors import (
    ConfigError,
    FedtrainError,
    MergeError,
    Refused,
    StateError,
    WireError,
    error_body,
)

log = logging.getLogger("fedtrain.coordinator")

#: The routers in the order their routes are matched and listed in the OpenAPI document.
ROUTERS = (web.router, admin.router, observability.router, membership.router, live_config.router,
           round_traffic.router, model_delta.router, secagg.router)


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
    app.state.service = service  # what the routes call (`routes.deps.coordinator`)
    app.state.uploads_in_flight = UploadsInFlight()  # one upload at a time per (participant, round)
    _add_error_handlers(app)
    app.add_middleware(BodyLimit, upload_limit=lambda: int(service.config.max_upload_mb * MB))  # type: ignore[arg-type]
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    for router in ROUTERS:
        _add_routes(app, router)
    return app


def _add_routes(app: FastAPI, router: APIRouter) -> None:
    """Add the routes of `router` to `app` as the app's own `APIRoute`s, as `include_router`
    did in older FastAPI (0.165, installed here, keeps an included router as one opaque entry
    of `app.routes`): the route table stays one flat list of `APIRoute`s whatever the version,
    for those who walk it (the test that every mutating route checks a role)."""
    for route in router.routes:
        if not isinstance(route, APIRoute):
            raise TypeError(f"{route!r}: the routers of the coordinator hold API routes only")
        app.add_api_route(
            route.path, route.endpoint, methods=sorted(route.methods or ()), name=route.name,
            response_model=route.response_model, status_code=route.status_code, summary=route.summary,
            description=route.description, response_description=route.response_description,
            responses=route.responses, response_class=route.response_class,
            include_in_schema=route.include_in_schema, openapi_extra=route.openapi_extra,
        )


def _add_error_handlers(app: FastAPI) -> None:
    """Answer every error in the one JSON shape of `error_body`."""

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
