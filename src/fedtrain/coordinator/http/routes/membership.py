"""Routes of a participant's life in the run: join, heartbeats, reported metrics, leave."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, Field

from fedtrain.coordinator.http.routes.deps import (
    BODY,
    MAX_COUNT,
    PID_PATTERN,
    ParticipantKey,
    Pid,
    coordinator,
    identity,
    speaker,
)
from fedtrain.coordinator.http.routes.links import JOIN_LINKS
from fedtrain.coordinator.members.auth import Identity, key_cookie
from fedtrain.coordinator.members.processes import MAX_INFO_BYTES, MAX_INFO_DEPTH, MAX_INFO_KEYS
from fedtrain.coordinator.members.roster import MAX_METRIC_NAME, MAX_METRIC_VALUES
from fedtrain.coordinator.service import Coordinator
from fedtrain.errors import Refused

router = APIRouter()


class TensorShape(BaseModel):
    model_config = BODY
    dtype: str = Field(..., max_length=16, description="safetensors dtype name (F32, BF16, ...).")
    shape: list[Annotated[int, Field(ge=0, le=MAX_COUNT)]] = Field(..., max_length=8)


class JoinRequest(BaseModel):
    model_config = BODY
    name: str | None = Field(None, min_length=1, max_length=64, pattern=PID_PATTERN,
                             description="Stable participant name (1-64 letters, digits, '_', '.' or '-'); "
                             "rejoining with it resumes the identity.")
    # The bounds are declared for the schema's readers (and the fuzzer) and checked by the roster,
    # which answers in its own words: 413 info_too_large, 400 invalid_info (`processes.check_info`).
    info: dict[str, Any] = Field(default_factory=dict, json_schema_extra={
        "maxProperties": MAX_INFO_KEYS, "x-max-json-bytes": MAX_INFO_BYTES, "x-max-depth": MAX_INFO_DEPTH},
        description=(
        "Free-form facts (host, ...). Two are checked (400 invalid_info) and shown in the status: `parallel` "
        "(single, ddp, fsdp; left out: one process) and `world_size` (its ranks, 1 to 2^20)."))
    model: dict[Annotated[str, Field(max_length=512)], TensorShape] | None = Field(
        None, max_length=100_000, description=(
            "The tensors this participant syncs (name -> dtype and shape; an FSDP group: the whole tensors). "
            "When given, a model that does not match the run's is refused here (409 model_mismatch, the "
            "differences listed) and nothing is added to the roster."))
    key_cookie: bool = Field(True, description="Also set the participant key as a cookie (`fedtrain-key-<id>`), "
                             "for HTTP clients with a cookie jar; a client that sends the key header itself "
                             "says false (a Set-Cookie would show the key in its HTTP debug logs).")


class HeartbeatRequest(BaseModel):
    model_config = BODY
    step: int = Field(0, ge=0, le=MAX_COUNT)
    round: int = Field(0, ge=0, le=MAX_COUNT)
    loss: float | None = Field(None, allow_inf_nan=False)
    tokens_per_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    steps_per_s: float | None = Field(None, ge=0, allow_inf_nan=False,
                                      description="Inner steps per second of the participant's own loop, the "
                                      "syncs left out: what balanced rounds set its H from.")
    config_version: int | None = Field(None, ge=1, le=MAX_COUNT, description="The config version the participant runs.")


class MetricsRequest(BaseModel):
    model_config = BODY
    round: int | None = Field(None, ge=0, le=MAX_COUNT)
    step: int | None = Field(None, ge=0, le=MAX_COUNT)
    values: dict[str, float] = Field(..., description="Metric name to finite value.", json_schema_extra={
        "maxProperties": MAX_METRIC_VALUES, "propertyNames": {"maxLength": MAX_METRIC_NAME}})  # checked: roster.py


@router.post("/v1/join", summary="Join the run: participant id and key, run config, current round, model spec",
             responses=JOIN_LINKS)
async def join(body: JoinRequest, request: Request, response: Response, key: ParticipantKey = None,
               ident: Identity = Depends(identity), service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    key = key or (request.cookies.get(key_cookie(body.name)) if body.name else None)
    model = None if body.model is None else {n: t.model_dump() for n, t in body.model.items()}
    answer = service.join(ident, body.name, body.info, key, model=model)
    if body.key_cookie:
        response.set_cookie(key_cookie(answer["participant_id"]), answer["participant_key"], path="/v1",
                            httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return answer


@router.post("/v1/participants/{pid}/heartbeat", summary="Heartbeat with progress")
async def heartbeat(pid: Pid, body: HeartbeatRequest, ident: Identity = Depends(speaker),
                    service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    return service.heartbeat(ident, pid, body.model_dump())


@router.post("/v1/participants/{pid}/leave", summary="Leave the run")
async def leave(pid: Pid, ident: Identity = Depends(speaker),
                service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    return service.leave(ident, pid)


@router.post("/v1/participants/{pid}/metrics", summary="Report metrics (losses, evals)")
async def metrics(pid: Pid, body: MetricsRequest, ident: Identity = Depends(speaker),
                  service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    bad = [k for k, v in body.values.items() if v != v or v in (float("inf"), float("-inf"))]
    if bad:
        raise Refused(422, "non_finite", f"metric values must be finite: {', '.join(bad)}")
    service.add_metrics(ident, pid, body.round, body.step, body.values)
    return {"stored": len(body.values)}
