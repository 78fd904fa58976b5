"""Admin routes: participant tokens (minted per site, listed, revoked), evictions, kept versions, roll backs.

Each one authenticates like any route; the service refuses a token that is not the admin's.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from fedtrain.coordinator.http.routes.deps import BODY, MAX_COUNT, Pid, coordinator, identity
from fedtrain.coordinator.members.auth import Identity
from fedtrain.coordinator.members.site_tokens import NAME_PATTERN
from fedtrain.coordinator.service import Coordinator

router = APIRouter()


class RevokeRequest(BaseModel):
    model_config = BODY
    token_id: str | None = Field(None, max_length=64, description="Fingerprint of the token (GET /v1/admin/tokens).")
    participant_id: str | None = Field(None, max_length=64, description="Revoke the token this participant used.")
    name: str | None = Field(None, min_length=1, max_length=64, pattern=NAME_PATTERN,
                             description="Revoke the live token of this name.")


class MintRequest(BaseModel):
    model_config = BODY
    name: str = Field(..., min_length=1, max_length=64, pattern=NAME_PATTERN,
                      description="The site's name, e.g. site-a: 1-64 letters, digits, '_', '.' or '-'.")


class RollbackRequest(BaseModel):
    model_config = BODY
    version: int = Field(..., ge=0, le=MAX_COUNT, description="A kept version (GET /v1/admin/checkpoints).")


@router.get("/v1/admin/tokens", summary="Admin: participant tokens by fingerprint, revoked or not, who used each")
async def list_tokens(ident: Identity = Depends(identity),
                      service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    return service.token_view(ident)


@router.post("/v1/admin/tokens", summary="Admin: mint a named participant token for a site (shown this once)")
async def mint_token(body: MintRequest, ident: Identity = Depends(identity),
                     service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    return service.mint_token(ident, body.name)


@router.post("/v1/admin/tokens/revoke", summary="Admin: revoke a participant token; its participants are evicted")
async def revoke_token(body: RevokeRequest, ident: Identity = Depends(identity),
                       service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    return service.revoke_token(ident, body.token_id, body.participant_id, body.name)


@router.get("/v1/admin/checkpoints", summary="Admin: the kept versions a roll back can go to")
async def kept_versions(ident: Identity = Depends(identity),
                        service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    return service.kept_versions(ident)


@router.post("/v1/admin/rollback", summary="Admin: put a kept version back in force as the next version")
async def rollback(body: RollbackRequest, ident: Identity = Depends(identity),
                   service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    return await service.roll_back_to(ident, body.version)


@router.post("/v1/participants/{pid}/evict", summary="Admin: evict a participant")
async def evict(pid: Pid, ident: Identity = Depends(identity),
                service: Coordinator = Depends(coordinator)) -> dict[str, Any]:
    return service.evict(ident, pid)
