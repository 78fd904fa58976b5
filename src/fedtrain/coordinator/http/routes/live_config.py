"""Routes of the live config: the config in force, changes (admin), checks, its history."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from fedtrain.coordinator.http.routes.deps import BODY, MAX_COUNT, PID_PATTERN, coordinator, identity, speaker_by_query
from fedtrain.coordinator.members.auth import Identity
from fedtrain.coordinator.service import Coordinator

router = APIRouter()


class ConfigChange(BaseModel):
    model_config = BODY
    changes: dict[str, Any] = Field(..., description="Fields to change, nested like the config (a merge patch).")


@router.get("/v1/config", summary="The config in force (now, or at `round`) and its version; with "
            "`participant_id`, also that participant's inner steps for the round (`assignment`)")
async def get_config(
    round: int | None = Query(None, ge=0, le=MAX_COUNT),
    participant_id: str | None = Query(None, min_length=1, max_length=64, pattern=PID_PATTERN,
                                       description="A participant this request speaks for (its key): the "
                                       "answer's `assignment` is its H for the round, fixed once told."),
    ident: Identity = Depends(speaker_by_query), service: Coordinator = Depends(coordinator),
) -> dict[str, Any]:
    return service.config_view(round, participant_id)


@router.put("/v1/config", summary="Admin: change the config live; in force from the next round boundary")
async def put_config(body: ConfigChange, ident: Identity = Depends(identity),
                     service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    return service.change_config(ident, body.changes)


@router.post("/v1/config/validate", summary="Admin: check a change without applying it")
async def validate_config(body: ConfigChange, ident: Identity = Depends(identity),
                          service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    return service.validate_config(ident, body.changes)


@router.get("/v1/config/history", summary="Accepted config versions: when, by whom, the diff")
async def config_history(
    limit: int = Query(50, ge=1, le=1000), ident: Identity = Depends(identity),
    service: Coordinator = Depends(coordinator),
) -> dict[str, Any]:
    return {"versions": service.config_history(limit)}
