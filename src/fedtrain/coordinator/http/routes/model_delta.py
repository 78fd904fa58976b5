"""The compressed download of the newest version (`GET /v1/model/delta?from=<version>`).

A participant that holds version r asks for r -> r + 1 as the compressed delta the coordinator
published (`coordinator/model/deltas.py`, `wire/delta.py`), applies it and checks the result
against the version's digest (`X-Fedtrain-Model-Digest`, also in the body's metadata). The
body is named by its own digest (ETag) and resumes with Range like the whole model
(`transport/ranges.py`). 404 `no_delta` when the run sends models whole, 409
`delta_unavailable` when `from` is not the version just before the newest (or the newest has
no delta): the participant then downloads the model whole.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, Response

from fedtrain.coordinator.http.routes.deps import (
    MAX_COUNT,
    IfMatchHeader,
    IfRangeHeader,
    PidQuery,
    RangeHeader,
    coordinator,
    speaker_by_query,
)
from fedtrain.coordinator.members.auth import Identity
from fedtrain.coordinator.model.publish import ModelResponse
from fedtrain.coordinator.service import Coordinator
from fedtrain.errors import Refused, error_body
from fedtrain.transport.ranges import Ranged, decide, etag_of
from fedtrain.wire import DIGEST_HEADER

router = APIRouter()

VERSION_HEADER = "X-Fedtrain-Version"
MODEL_DIGEST_HEADER = "X-Fedtrain-Model-Digest"  # the digest of the version the delta leads to


@router.get(
    "/v1/model/delta",
    summary="Download the newest global version as a compressed delta from the version before it "
    "(train.download_compression); byte ranges resume it",
    responses={200: {"content": {"application/octet-stream": {}}},
               206: {"description": "the byte range asked for (`Range`, with `If-Range` the body's ETag)",
                     "content": {"application/octet-stream": {}}},
               404: {"description": "no_delta: this run sends the model whole"},
               409: {"description": "delta_unavailable: `from` is not the version before the newest, or the "
                                    "newest has no delta; download the model whole"},
               412: {"description": "`If-Match` names another body than the one served now"},
               416: {"description": "the range starts past the end, is malformed, or is more than one range"}},
)
async def model_delta(
    from_version: int = Query(..., alias="from", ge=0, le=MAX_COUNT,
                              description="the version the participant holds (its digest checked)"),
    participant_id: PidQuery = None,  # counted as its download: only by itself (`speaker_by_query`)
    range_: RangeHeader = None,
    if_range: IfRangeHeader = None,
    if_match: IfMatchHeader = None,
    ident: Identity = Depends(speaker_by_query),
    service: Coordinator = Depends(coordinator),
) -> Response:
    stream = service.model_delta(from_version)
    etag = etag_of(stream.digest)
    try:
        span = decide(stream.size, etag, range_, if_range, if_match)
    except Refused as e:
        headers = {"ETag": etag, "Accept-Ranges": "bytes"}
        if e.status == 416:
            headers["Content-Range"] = f"bytes */{stream.size}"
        return JSONResponse(error_body(e.status, e.code, e.message, e.details), e.status, headers)
    headers = {
        "Content-Length": str(span.length), DIGEST_HEADER: stream.digest, VERSION_HEADER: str(stream.version),
        MODEL_DIGEST_HEADER: stream.delta.target.digest, "ETag": etag, "Accept-Ranges": "bytes",
    }
    if span.partial:
        headers["Content-Range"] = span.content_range()
    who = participant_id if participant_id is not None else None if ident.is_admin else f"token {ident.token_id}"
    tracked = service.begin_download(who, participant_id, etag, f"delta to version {stream.version}", span.length,
                                     stream.version, fp32_scale=stream.fp32_scale)
    body = Ranged(stream, span, tracked.add, tracked.end)
    return ModelResponse(body, headers, status_code=206 if span.partial else 200)
