"""Routes of the coordinator's web face: the dashboard page at `/`, `/v1` (where things are),
`/v1/whoami` and the Prometheus `/metrics` endpoint. The page's files and the headers it is
served with live in `coordinator/dashboard/`; `create_app` mounts its static assets.

`/metrics` needs a token of the run too (any role), sent by Prometheus as
`authorization: {credentials: ...}`.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, PlainTextResponse

import fedtrain
from fedtrain.coordinator.http import prometheus
from fedtrain.coordinator.http.dashboard import PAGE_HEADERS, STATIC_DIR
from fedtrain.coordinator.http.routes.deps import coordinator, identity
from fedtrain.coordinator.members.auth import Identity
from fedtrain.coordinator.service import Coordinator

router = APIRouter()


@router.get("/", include_in_schema=False)
async def dashboard() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get("/v1", summary="Where things are (no token needed)")
async def api_index() -> dict[str, Any]:
    return {
        "fedtrain": fedtrain.__version__,
        "api": "/v1",
        "docs": "/v1/docs",
        "openapi": "/v1/openapi.json",
        "dashboard": "/",
        "metrics": "/metrics",
    }


@router.get("/v1/whoami", summary="The role of the token sent (participant or admin) and the server's clock")
async def whoami(ident: Identity = Depends(identity)) -> dict[str, Any]:
    return {"role": ident.role, "server_time": time.time()}


@router.get(
    "/metrics",
    summary="Prometheus text exposition: rounds, participants by state, bytes, round and merge times",
    response_class=PlainTextResponse,
    responses={200: {"content": {prometheus.CONTENT_TYPE: {}}}},
)
async def metrics(
    ident: Identity = Depends(identity), service: Coordinator = Depends(coordinator)
) -> PlainTextResponse:
    text = prometheus.render(service.status(), service.round_timings(), service.broadcast.count)
    return PlainTextResponse(text, media_type=prometheus.CONTENT_TYPE)
