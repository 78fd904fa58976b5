"""Routes of secure aggregation (`/v1/rounds/{r}/secagg/...`): a round's phase, public keys and
token claims (with the keys, or after training: `claim`), the key directory, sealed shares, a
participant's mailbox, the unmask request and the revealed shares. Masked updates themselves go
through the update route.

Every request speaks for the participant of its path (or `participant_id`) with its key, as the
other round routes do; every body is bounded in its schema (`privacy.secagg_max_participants`
bounds what a round holds: `coordinator/secagg/attempt.py`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field, StringConstraints

from fedtrain.config.privacy import MAX_SECAGG_PARTICIPANTS
from fedtrain.coordinator.http.routes.deps import (
    BODY,
    MAX_TOKEN_CLAIM,
    Pid,
    PidQuery,
    Round,
    coordinator,
    speaker,
    speaker_by_query,
)
from fedtrain.coordinator.members.auth import Identity
from fedtrain.coordinator.secagg import SecureAggregation
from fedtrain.coordinator.service import Coordinator
from fedtrain.errors import Refused
from fedtrain.privacy.keys import KEY_BYTES
from fedtrain.privacy.shamir import SHARE_BYTES
from fedtrain.privacy.shares import SEALED_BYTES

router = APIRouter()


def spoken_for(ident: Identity = Depends(speaker), service: Coordinator = Depends(coordinator)) -> SecureAggregation:
    """The run's secure aggregation, for a request that speaks for the participant of its path
    (409 secagg_off without it)."""
    return service.secure_aggregation()


#: A route's secure aggregation, its request speaking for the participant of its path.
SecAgg = Annotated[SecureAggregation, Depends(spoken_for)]

Session = Annotated[str, StringConstraints(min_length=16, max_length=16, pattern=r"^[0-9a-f]{16}$")]
KeyHex = Annotated[str, StringConstraints(pattern=rf"^[0-9a-f]{{{2 * KEY_BYTES}}}$")]
SealedHex = Annotated[str, StringConstraints(pattern=rf"^[0-9a-f]{{{2 * SEALED_BYTES}}}$")]
ShareHex = Annotated[str, StringConstraints(pattern=rf"^[0-9a-f]{{{2 * SHARE_BYTES}}}$")]
IdKey = Annotated[str, StringConstraints(pattern=r"^[1-9][0-9]{0,9}$")]
SessionQuery = Annotated[str, Query(min_length=16, max_length=16, pattern=r"^[0-9a-f]{16}$",
                                    description="The attempt's session.")]


class Keys(BaseModel):
    model_config = BODY
    session: Session
    mask: KeyHex
    channel: KeyHex
    tokens: int | None = Field(None, ge=0, le=MAX_TOKEN_CLAIM, description="The tokens of the update it will "
                               "upload (public: they set its weight, fixed when the claims phase closes); omitted "
                               "by a participant that exchanges keys before training and claims after it.")


class Claim(BaseModel):
    model_config = BODY
    session: Session
    tokens: int = Field(ge=0, le=MAX_TOKEN_CLAIM, description="The tokens of the update it will upload (public), "
                        "once, by a participant that advertised its keys without them.")


class Shares(BaseModel):
    model_config = BODY
    session: Session
    shares: dict[IdKey, SealedHex] = Field(max_length=MAX_SECAGG_PARTICIPANTS,
                                           description="recipient id -> its sealed bundle, one per neighbour")


class Revealed(BaseModel):
    model_config = BODY
    owner: int = Field(ge=1, le=2**31 - 1)
    kind: Literal["seed", "key"]
    share: ShareHex


class Reveal(BaseModel):
    model_config = BODY
    session: Session
    shares: list[Revealed] = Field(max_length=MAX_SECAGG_PARTICIPANTS)


@router.get("/v1/rounds/{round_}/secagg", summary="A round's secure aggregation: phase, session, setup, your id; "
            "long-polls up to `wait` seconds while it is still in `phase`")
async def secagg_state(
    round_: Round,
    wait: float = Query(0.0, ge=0, le=60),
    phase: Literal["keys", "shares", "claims", "upload", "reveal", "done"] | None = Query(None),
    session: str | None = Query(None, min_length=16, max_length=16, pattern=r"^[0-9a-f]{16}$"),
    participant_id: PidQuery = None,
    ident: Identity = Depends(speaker_by_query),
    service: Coordinator = Depends(coordinator),
) -> dict[str, Any]:
    return await service.secure_aggregation().state(participant_id, round_, wait, phase, session)


@router.post("/v1/rounds/{round_}/secagg/keys/{pid}", summary="Advertise a participant's two public keys and "
             "its token claim (keys phase)")
async def secagg_keys(round_: Round, pid: Pid, body: Keys, secagg: SecAgg) -> dict[str, Any]:
    return secagg.advertise(pid, round_, body.session, {"mask": body.mask, "channel": body.channel}, body.tokens)


@router.post("/v1/rounds/{round_}/secagg/claim/{pid}", summary="A participant's token claim, once, if it did "
             "not claim with its keys (shares or claims phase)")
async def secagg_claim(round_: Round, pid: Pid, body: Claim, secagg: SecAgg) -> dict[str, Any]:
    return secagg.claim(pid, round_, body.session, body.tokens)


@router.get("/v1/rounds/{round_}/secagg/directory/{pid}", summary="The round's public keys, weights and your "
            "neighbours (from the shares phase on)")
async def secagg_directory(round_: Round, pid: Pid, session: SessionQuery, secagg: SecAgg) -> dict[str, Any]:
    return secagg.directory(pid, round_, session)


@router.post("/v1/rounds/{round_}/secagg/shares/{pid}", summary="Post a participant's sealed shares, one bundle "
             "per neighbour, once (shares phase)")
async def secagg_shares(round_: Round, pid: Pid, body: Shares, secagg: SecAgg) -> dict[str, Any]:
    return secagg.post_shares(pid, round_, body.session, dict(body.shares))


@router.get("/v1/rounds/{round_}/secagg/mailbox/{pid}", summary="The sealed bundles sent to you and who shared "
            "(from the claims phase on)")
async def secagg_mailbox(round_: Round, pid: Pid, session: SessionQuery, secagg: SecAgg) -> dict[str, Any]:
    return secagg.mailbox(pid, round_, session)


@router.get("/v1/rounds/{round_}/secagg/unmask/{pid}", summary="The unmask request: survivors and dropped "
            "(reveal phase)")
async def secagg_unmask(round_: Round, pid: Pid, session: SessionQuery, secagg: SecAgg) -> dict[str, Any]:
    return secagg.unmask_request(pid, round_, session)


@router.post("/v1/rounds/{round_}/secagg/reveal/{pid}", summary="Post a survivor's revealed shares, once "
             "(reveal phase)")
async def secagg_reveal(round_: Round, pid: Pid, body: Reveal, secagg: SecAgg) -> dict[str, Any]:
    if not body.shares:
        raise Refused(400, "secagg_reveal", "a survivor reveals at least its own seed's share")
    return secagg.post_reveal(pid, round_, body.session, [s.model_dump() for s in body.shares])
