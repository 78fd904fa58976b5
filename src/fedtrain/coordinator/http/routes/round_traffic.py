"""Routes of the rounds: a round's status (long-polled), uploads of updates, model downloads
(whole, or some rows of it: `slices.py`; a byte range of either: `transport/ranges.py`).

Tensor bodies stream in both directions; nothing here buffers a whole body. One upload at a
time per (participant, round[, part]): a newer attempt takes over from the one in progress
(whose connection the client gave up), which is closed and ends first, so two copies of an
update never race into the round and a dead connection never blocks its own retry. An update
larger than `transfer.part_mb` comes as parts (`?part=`, `intake/parts.py`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from fedtrain.coordinator.http.limits import UploadsInFlight
from fedtrain.coordinator.http.routes.deps import (
    MAX_COUNT,
    MAX_TOKEN_CLAIM,
    IfMatchHeader,
    IfRangeHeader,
    Pid,
    PidQuery,
    RangeHeader,
    Round,
    coordinator,
    speaker,
    speaker_by_query,
    upload_body,
)
from fedtrain.coordinator.http.routes.links import ROUND_LINKS, UPLOAD_LINKS
from fedtrain.coordinator.intake.parts import MAX_PART_BYTES, MAX_PARTS, MIN_PART_BYTES, PartClaim
from fedtrain.coordinator.members.auth import Identity
from fedtrain.coordinator.model.publish import ModelResponse, ModelStream
from fedtrain.coordinator.model.slices import MAX_ROWS_CHARS, SliceStream
from fedtrain.coordinator.service import Coordinator
from fedtrain.errors import Refused, error_body
from fedtrain.transport.protocols import READINTO, Abandoned
from fedtrain.transport.ranges import Ranged, decide, etag_of
from fedtrain.wire import DIGEST_HEADER

router = APIRouter()

VERSION_HEADER = "X-Fedtrain-Version"
UPLOAD_RETRY_AFTER_S = 1.0  # what a 429 upload_in_progress asks the client to wait
MAX_DIGEST_CHARS = 128  # the longest digest header (sha256:<64 hex> is 71 characters)
WHOLE_DIGEST_HEADER = "X-Fedtrain-Upload-Digest"  # a part's: the digest of the whole body it is part of
MAX_TOTAL_BYTES = 1 << 44  # the largest body a part may claim (max_upload_mb refuses most before)


async def uploads_in_flight(request: Request) -> UploadsInFlight:
    """The uploads in progress on the app of `request` (its own, set by `create_app`)."""
    in_flight: UploadsInFlight = request.app.state.uploads_in_flight
    return in_flight


@router.get("/v1/rounds/{round_}", summary="Round status; long-polls up to `wait` seconds while it is open",
            responses=ROUND_LINKS)
async def round_status(
    round_: Round,
    wait: float = Query(0.0, ge=0, le=60),
    participant_id: PidQuery = None,
    piece: str | None = Query(None, min_length=1, max_length=64,
                              description="with participant_id: whether this piece of its update is in"),
    ident: Identity = Depends(speaker_by_query),
    service: Coordinator = Depends(coordinator),
    in_flight: UploadsInFlight = Depends(uploads_in_flight),
) -> dict[str, Any]:
    info = await service.wait_round(ident, participant_id, round_, wait, piece)
    if participant_id is not None:  # a retry asks this before it sends its body again (a 429 costs the body)
        info["upload_in_progress"] = in_flight.holds((participant_id, round_, piece))
    return info


@router.put(
    "/v1/rounds/{round_}/updates/{pid}",
    summary="Upload a pseudo-gradient (safetensors body) for a round, whole or as one of its parts; "
    "idempotent per (round, participant)",
    responses=UPLOAD_LINKS,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def upload(
    round_: Round,
    pid: Pid,
    request: Request,
    tokens: int = Query(..., ge=0, le=MAX_TOKEN_CLAIM),
    piece: str | None = Query(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                              description="this body is one piece of the update, so labelled (docs/training-jobs.md)"),
    part: int | None = Query(None, ge=0, le=MAX_PARTS - 1,
                             description="this body is part `part` of the body named by `total`, `part_bytes` "
                             f"and {WHOLE_DIGEST_HEADER}: its bytes [part * part_bytes, min(total, (part + 1) * "
                             "part_bytes))"),
    total: int | None = Query(None, ge=1, le=MAX_TOTAL_BYTES, description="with part: bytes of the whole body"),
    part_bytes: int | None = Query(None, ge=MIN_PART_BYTES, le=MAX_PART_BYTES,
                                   description="with part: bytes of every part but the last"),
    digest: str | None = Header(None, alias=DIGEST_HEADER, max_length=MAX_DIGEST_CHARS,
                                description="<algorithm>:<hex> of the body (xxh3-128 or sha256); with part: of the "
                                "part"),
    whole_digest: str | None = Header(None, alias=WHOLE_DIGEST_HEADER, max_length=MAX_DIGEST_CHARS,
                                      description="with part: <algorithm>:<hex> of the whole body"),
    ident: Identity = Depends(speaker),
    service: Coordinator = Depends(coordinator),
    in_flight: UploadsInFlight = Depends(uploads_in_flight),
) -> Any:
    if not digest:
        raise Refused(400, "digest_required",
                      f"uploads need a {DIGEST_HEADER} header (xxh3-128:<hex> or sha256:<hex> of the body)")
    claim = _part_claim(part, total, part_bytes, whole_digest, tokens)
    length_header = request.headers.get("content-length")
    try:
        length = int(length_header) if length_header is not None else None
    except ValueError:
        raise Refused(400, "invalid_length", "Content-Length is not a number") from None
    body = upload_body(request)
    source = request.scope.get("extensions", {}).get(READINTO)
    key = (pid, round_, piece) if claim is None else (pid, round_, piece, claim.index)
    # A newer attempt takes over from one in progress (its connection gone silent): the older
    # is closed and ends; this one goes on once it has (`intake/attempts.py`).
    attempt = await service.attempts.begin(key, source.close if source is not None else body.abandon)
    if attempt is None:
        raise Refused(429, "upload_in_progress", f"an upload of {pid} for round {round_} is still ending on another "
                      "connection; send again shortly", {"round": round_, "retry_after_s": UPLOAD_RETRY_AFTER_S})
    in_flight.take(key)  # (free: the attempt before this one has ended)
    try:
        if claim is None:
            return await service.receive_update(ident, pid, round_, tokens, digest, length, body, piece)
        return await service.receive_part(ident, pid, round_, claim, digest, length, body, piece)
    except (ClientDisconnect, Abandoned):
        if attempt.stopped:  # taken over: the answer goes nowhere (fast path) or closes the connection
            return JSONResponse(error_body(409, "taken_over", "a newer attempt of this upload took over"),
                                status_code=409, headers={"Connection": "close"})
        raise Refused(400, "client_disconnected", "the upload ended before the body was complete") from None
    finally:
        in_flight.give_back(key)
        service.attempts.end(key, attempt)


def _part_claim(part: int | None, total: int | None, part_bytes: int | None, whole: str | None,
                tokens: int) -> PartClaim | None:
    """The claims of a part (None: a whole upload); all of them, or none."""
    given = [x is not None for x in (part, total, part_bytes, whole)]
    if not any(given):
        return None
    if not all(given):
        raise Refused(400, "part_fields", f"a part needs part, total, part_bytes and {WHOLE_DIGEST_HEADER}, all four")
    assert part is not None and total is not None and part_bytes is not None and whole is not None
    return PartClaim(part, total, part_bytes, whole, tokens)


@router.get("/v1/rounds/{round_}/updates/{pid}/parts",
            summary="Which parts of an upload in parts the coordinator holds (a resumed upload sends the rest)")
async def upload_parts(
    round_: Round,
    pid: Pid,
    piece: str | None = Query(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"),
    ident: Identity = Depends(speaker),
    service: Coordinator = Depends(coordinator),
) -> dict[str, Any]:
    return service.part_session(ident, pid, round_, piece)


@router.get(
    "/v1/model",
    summary="Download the global model, or some rows of it (safetensors stream); byte ranges resume a download",
    responses={200: {"content": {"application/octet-stream": {}}},
               206: {"description": "the byte range asked for (`Range`, with `If-Range` the body's ETag)",
                     "content": {"application/octet-stream": {}}},
               412: {"description": "`If-Match` names another body than the one served now"},
               416: {"description": "the range starts past the end, is malformed, or is more than one range"}},
)
async def model(
    version: int | None = Query(None, ge=0, le=MAX_COUNT),
    participant_id: PidQuery = None,  # counted as its download: only by itself (`speaker_by_query`)
    rows: str | None = Query(None, min_length=1, max_length=MAX_ROWS_CHARS,
                             description="only these rows: a JSON object mapping tensor names to "
                             "[start, stop] (rows along dimension 0) or null (whole); docs/training-jobs.md"),
    range_: RangeHeader = None,
    if_range: IfRangeHeader = None,
    if_match: IfMatchHeader = None,
    ident: Identity = Depends(speaker_by_query),
    service: Coordinator = Depends(coordinator),
) -> Response:
    stream: ModelStream | SliceStream
    if rows is None:  # (counted as participant_id's download below: the bytes it is sent)
        stream = service.model_stream(version)
    else:
        stream = await service.model_slice(version, None, rows)
    etag = etag_of(stream.digest)  # of the exact body served: a slice has its own
    try:
        span = decide(stream.size, etag, range_, if_range, if_match)
    except Refused as e:
        stream.close()
        headers = {"ETag": etag, "Accept-Ranges": "bytes"}
        if e.status == 416:
            headers["Content-Range"] = f"bytes */{stream.size}"
        return JSONResponse(error_body(e.status, e.code, e.message, e.details), e.status, headers)
    headers = {
        "Content-Length": str(span.length), DIGEST_HEADER: stream.digest, VERSION_HEADER: str(stream.version),
        "ETag": etag, "Accept-Ranges": "bytes",
    }
    if span.partial:
        headers["Content-Range"] = span.content_range()
    # In flight, counted (and capped) per participant: its progress shows in the status; one that
    # names no participant counts against its token, so that leaving the name out escapes no cap.
    who = participant_id if participant_id is not None else None if ident.is_admin else f"token {ident.token_id}"
    what = f"download of version {stream.version}" + (" (rows)" if rows is not None else "")
    try:
        tracked = service.begin_download(who, participant_id, etag, what, span.length, stream.version)
    except Refused:
        stream.close()
        raise
    body = Ranged(stream, span, tracked.add, tracked.end)
    return ModelResponse(body, headers, status_code=206 if span.partial else 200)
