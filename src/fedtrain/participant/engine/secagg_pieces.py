"""An FSDP group's blocking sync under secure aggregation: each rank masks and uploads its own rows
as its piece of the participant's one masked update.

    1. rank 0 runs round r's protocol up to the public weights (`secagg_sync.lead_join`), while
       every rank keeps the group alive (`RankGroup.together`);
    2. rank 0 tells its ranks the round's self and pairwise seeds, its public weight and the
       tokens counted, over the group's own gloo control channel (`RankGroup.broadcast_json`:
       JSON in byte tensors; the seeds never leave the participant's processes);
    3. with DP, the clip is over the assembled update: the ranks all-reduce the squared norms of
       the rows they send (`RankGroup.sum`) and each scales its rows by min(1, C / ‖Δ‖);
    4. each rank encodes `w · Δ` of its rows (with DP: the clipped, weighted rows plus its share of
       the noise), adds the masks' slice at the rows' element offsets (`GroupMasks.mask_rows`),
       and uploads the piece; rank 0 reveals the shares the unmask request asks for; every rank
       waits for the merge and downloads its rows.

The pieces together are byte for byte the body the participant would have masked whole, so the
coordinator folds them into the ring sum once they cover the round's tensors
(`coordinator/intake/masked_pieces.py`). Steps 2 and 3 run on the main thread, between two
`together` calls: the control channel's collectives are entered by every rank in one order.

Overlapped (`train.overlap`, Streaming DiLoCo with τ > 0), the same steps run on each rank's sync
worker thread while training goes on (`exchange_masked_piece`), their collectives on the group's
second channel (`RankGroup.for_worker`); the ranks' outcomes meet where the exchange lands.
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any

import torch

from fedtrain.config import RunConfig
from fedtrain.errors import CoordinatorUnavailable
from fedtrain.participant.client.retry import RetryPolicy
from fedtrain.participant.engine.outage import is_transient
from fedtrain.participant.engine.secagg_sync import Lead, lead_finish, lead_join
from fedtrain.participant.engine.sync import SyncEngine
from fedtrain.participant.ranks.control import DistributedSyncError, Outcome, RankGroup
from fedtrain.privacy.participant_round import GroupMasks
from fedtrain.privacy.round_setup import SECAGG_META
from fedtrain.wire import EncodedBody
from fedtrain.wire.format import ROWS_META

__all__ = ["exchange_masked_piece", "exchange_masked_pieces", "masked_piece", "sent_square_norm"]


def exchange_masked_pieces(ranks: RankGroup, engine: SyncEngine, r: int, pid: str, config: RunConfig, *,
                           tokens: int, retry: RetryPolicy | None = None) -> tuple[list[Outcome], BaseException | None]:
    """Round r's blocking exchange for this rank of an FSDP group (every rank calls it at once):
    every rank's outcome (the global version it downloaded) and its own error, as `together`
    gives them. On a failure every rank's snapshot holds the round's reference again."""
    if engine.holds in ("cut_short", "fetched"):  # round r is over for us: download only
        return ranks.together(lambda: _download(engine, r, pid, config, retry), cancel=engine.cancel)
    engine.take_delta()
    lead: Lead | None = None

    def join() -> None:
        nonlocal lead
        lead = lead_join(engine, r, pid, config, tokens=tokens, retry=retry)

    outcomes, error = ranks.together(join if ranks.lead else None, cancel=engine.cancel)
    if not all(o.ok for o in outcomes):
        engine.restore()
        return outcomes, error
    told = ranks.broadcast_json(lead.payload() if lead is not None else None)
    factor = _clip_factor(ranks, engine, told, config)
    outcomes, error = ranks.together(lambda: _send_and_fetch(engine, lead, told, factor, r, pid, config, retry),
                                     cancel=engine.cancel)
    if not all(o.ok for o in outcomes):
        engine.restore()
    return outcomes, error


def exchange_masked_piece(ranks: RankGroup, engine: SyncEngine, r: int, pid: str, config: RunConfig, *,
                          tokens: int, retry: RetryPolicy | None = None) -> int:
    """Round r's masked exchange for this rank of an FSDP group on the overlapped sync's worker
    thread (`sync_schedule.Exchanges.send`, Δ already taken), while training goes on: the steps of
    `exchange_masked_pieces` with their collectives on `ranks`, the group's worker channel
    (`RankGroup.for_worker`). Rank 0 always tells its ranks whether it joined, so no rank waits
    on a collective that will not come. The new global version; a failure is raised, and the
    ranks' outcomes meet where the exchange lands (`together` over `Exchanges.result`)."""
    engine.deltas = config.train.download_compression != "none"
    lead: Lead | None = None
    failure: BaseException | None = None
    if ranks.lead:
        try:
            lead = lead_join(engine, r, pid, config, tokens=tokens, retry=retry)
        except BaseException as e:  # noqa: BLE001 - raised below, once the ranks know
            failure = e
    transient = failure is not None and is_transient(failure)
    said = ranks.broadcast_json({"failed": failure is not None, "transient": transient,
                                 "told": lead.payload() if lead is not None else None})
    if failure is not None:
        raise failure
    if said["failed"]:  # rank 0's outage is every rank's: ridden out alike, not a lasting failure here
        message = f"rank 0 of this participant could not join round {r}'s secure aggregation"
        raise CoordinatorUnavailable(message, status=0, code="unavailable") if said["transient"] else \
            DistributedSyncError(message)
    told = said["told"]
    factor = _clip_factor(ranks, engine, told, config)
    return _send_and_fetch(engine, lead, told, factor, r, pid, config, retry)


def _clip_factor(ranks: RankGroup, engine: SyncEngine, told: dict[str, Any] | None, config: RunConfig) -> float:
    """With DP, min(1, C / ‖Δ‖) over the assembled update (every rank enters the sum); else 1."""
    p = config.privacy
    if told is None or p is None or not p.dp:
        return 1.0
    norm = math.sqrt(ranks.sum([sent_square_norm(engine)])[0])
    return min(1.0, p.clip_norm / norm) if norm > 0 else 1.0


def _send_and_fetch(engine: SyncEngine, lead: Lead | None, told: dict[str, Any] | None, factor: float, r: int,
                    pid: str, config: RunConfig, retry: RetryPolicy | None) -> int:
    """This rank's masked piece up (rank 0 also reveals and waits for the merge), then its rows of
    the new global model down; with `told` None (our update is not in the round), the download only."""
    if told is not None:
        body = masked_piece(engine, GroupMasks.from_json(told["masks"]), told, factor, config.digest)
        if lead is not None:
            lead_finish(engine, lead, pid, config, body if body.data_length else None, retry)
        else:
            engine.submit(r, pid, body, config, tokens=int(told["counted"]), retry=retry)
    return _download(engine, r, pid, config, retry)


def masked_piece(engine: SyncEngine, masks: GroupMasks, told: dict[str, Any], factor: float,
                 digest: str = "sha256") -> EncodedBody:
    """This rank's rows of Δ (the snapshot after `take_delta`), flat, weighted (with DP: scaled by
    the group's clip `factor` and noised with `told["std"]` per coordinate, drawn from the OS
    CSPRNG) and masked at their element offsets, as a piece: `fedtrain.rows` names each
    tensor's element range of the flat ring tensor."""
    piece = engine.piece
    assert piece is not None
    delta = engine.delta_view()
    weight, std = float(told["weight"]), float(told["std"])
    gen = torch.Generator().manual_seed(secrets.randbits(63)) if std > 0 else None
    tensors: dict[str, torch.Tensor] = {}
    ranges: dict[str, list[int]] = {}
    for name in sorted(piece.sends):
        t = delta[name]
        _, shape = piece.shapes[name]
        start = piece.rows[name][0] if name in piece.rows else 0
        offset = start * math.prod(shape[1:])
        values, w = t, weight
        if gen is not None or factor != 1.0:  # DP: w · clip(Δ) + noise, encoded with weight 1
            values = t.detach().to(torch.float64) * (factor * weight)
            if gen is not None:
                values = values + torch.randn(values.shape, generator=gen, dtype=torch.float64) * std
            w = 1.0
        tensors[name] = torch.from_numpy(masks.mask_rows(name, values, w, offset))
        ranges[name] = [offset, offset + t.numel()]
    meta = {SECAGG_META: json.dumps({"session": told["session"], "bits": masks.fixed_point.bits}),
            ROWS_META: json.dumps(ranges)}
    return EncodedBody(tensors, meta, digest_algorithm=digest)


def sent_square_norm(engine: SyncEngine) -> float:
    """The squared L2 norm of the rows this rank sends (a tensor every rank holds whole counts
    once: rank 0 alone sends it)."""
    piece = engine.piece
    assert piece is not None
    delta = engine.delta_view()
    return sum(float(delta[n].detach().to(torch.float64).square().sum()) for n in piece.sends)


def _download(engine: SyncEngine, r: int, pid: str, config: RunConfig, retry: RetryPolicy | None) -> int:
    engine.deltas = config.train.download_compression != "none"
    return engine.download(pid, after_round=r, retry=retry, transfer=config.transfer)
