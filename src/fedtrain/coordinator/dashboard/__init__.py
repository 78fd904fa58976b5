"""The coordinator's web face: the dashboard page at `/`, its static assets, `/v1/whoami`
and the Prometheus `/metrics` endpoint.

The page is plain HTML, CSS and JavaScript under `static/` (no build step, no CDN: it
works on a machine with no internet). It holds no secret: it asks for a run token, keeps
it in the browser's localStorage and sends it as a bearer token to the same `/v1` API
as every other client, so participant tokens see a read-only dashboard and only the
admin token may change the config or evict. `/metrics` needs a token of the run too
(any role), sent by Prometheus as `authorization: {credentials: ...}`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles

import fedtrain
from fedtrain.coordinator import prometheus
from fedtrain.coordinator.auth import Identity
from fedtrain.coordinator.service import Coordinator

STATIC_DIR = Path(__file__).parent / "static"

#: The page loads only its own files and talks only to its own origin.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_routes(app: FastAPI, service: Coordinator, identity: Callable[[Request], Identity]) -> None:
    """Add `/`, `/static/...`, `/v1`, `/v1/whoami` and `/metrics` to the coordinator's app."""

    @app.get("/", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/v1", summary="Where things are (no token needed)")
    async def api_index() -> dict[str, Any]:
        return {
            "fedtrain": fedtrain.__version__,
            "api": "/v1",
            "docs": "/v1/docs",
            "openapi": "/v1/openapi.json",
            "dashboard": "/",
            "metrics": "/metrics",
        }

    @app.get("/v1/whoami", summary="The role of the token sent (participant or admin) and the server's clock")
    async def whoami(ident: Identity = Depends(identity)) -> dict[str, Any]:
        return {"role": ident.role, "server_time": time.time()}

    @app.get(
        "/metrics",
        summary="Prometheus text exposition: rounds, participants by state, bytes, round and merge times",
        response_class=PlainTextResponse,
        responses={200: {"content": {prometheus.CONTENT_TYPE: {}}}},
    )
    async def metrics(ident: Identity = Depends(identity)) -> PlainTextResponse:
        text = prometheus.render(service.status(), service.store.round_timings(), service.broadcast.count)
        return PlainTextResponse(text, media_type=prometheus.CONTENT_TYPE)
