"""Routes that show the run: liveness, status, events, reported metrics and the event stream.

The stream (`/v1/stream`) sends server-sent events: a `hello` with the config and the
status, then config changes, run events and status updates as they happen (`broadcast.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from fedtrain.coordinator.http.routes.deps import coordinator, identity, response_sink, stream_identity
from fedtrain.coordinator.members.auth import Identity
from fedtrain.coordinator.service import Coordinator
from fedtrain.coordinator.state.broadcast import sse

router = APIRouter()

STREAM_KEEPALIVE_S = 15.0
MAX_METRIC_NAME = 256  # the longest metric name `GET /v1/metrics?name=` asks for
STREAM_SEND_BUFFER = 64 << 10  # kernel bytes an event stream may have unsent (`ResponseSink.limit_kernel_buffer`)


@router.get("/v1/healthz", summary="Liveness (no token needed)")
async def healthz(service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    return {"ok": True, "current_round": service.version}


@router.get("/v1/stream", summary="Server-sent events: config changes, run events, status updates",
            responses={200: {"content": {"text/event-stream": {}}}})
async def stream(request: Request, ident: Identity = Depends(stream_identity),
                 service: Coordinator = Depends(coordinator)) -> StreamingResponse:
    subscription = service.broadcast.subscribe()
    sink = response_sink(request)
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


@router.get("/v1/status", summary="Run state: rounds, participants, bytes")
async def status(ident: Identity = Depends(identity), service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    return service.status()


@router.get("/v1/events", summary="Recent events of the run")
async def events(limit: int = Query(100, ge=1, le=10000), ident: Identity = Depends(identity),
                 service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    return {"events": service.event_log(limit)}


@router.get("/v1/metrics", summary="Reported metrics")
async def get_metrics(
    name: str | None = Query(None, min_length=1, max_length=MAX_METRIC_NAME),
    limit: int = Query(10000, ge=1, le=100000), ident: Identity = Depends(identity),
    service: Coordinator = Depends(coordinator),
) -> dict[str, Any]:
    return {"metrics": service.metrics(name, limit)}
