"""An FSDP rank's masked piece (`participant/engine/secagg_pieces.py`): two ranks' pieces, side by
side, are byte for byte the body the participant would mask whole, with the weight applied before
masking; with DP the clip is over the assembled update (the ranks' squared norms summed), not over
each rank's rows, and a tensor every rank holds whole counts once (rank 0 sends it)."""

from __future__ import annotations

import json
import math
import secrets
from typing import Any, cast

import numpy as np
import pytest
import torch
from safetensors.torch import load

from fedtrain.participant.client.coordinator_client import CoordinatorClient
from fedtrain.participant.engine.secagg_pieces import masked_piece, sent_square_norm
from fedtrain.participant.engine.sync import SyncEngine
from fedtrain.participant.engine.sync_set import PieceOf
from fedtrain.privacy.clipping import clip_update
from fedtrain.privacy.participant_round import GroupMasks
from fedtrain.privacy.ring import FixedPoint
from fedtrain.wire.format import ROWS_META

SHAPES = {"w": (5, 7), "b": (5,), "norm": (3,)}  # "norm": held whole by every rank (not sharded)
ROWS = [{"w": (0, 3), "b": (0, 3)}, {"w": (3, 5), "b": (3, 5)}]


def rank_engine(k: int, whole: dict[str, torch.Tensor], theta: dict[str, torch.Tensor]) -> SyncEngine:
    """Rank k's engine holding its rows, with Δ = whole − theta taken."""
    rows = ROWS[k]
    mine = {n: (whole[n][slice(*rows[n])] if n in rows else whole[n]).clone() for n in SHAPES}
    piece = PieceOf(f"rank{k}", frozenset(n for n in SHAPES if k == 0 or n in rows), rows,
                    {n: (torch.float32, s) for n, s in SHAPES.items()})
    params = {n: (theta[n][slice(*rows[n])] if n in rows else theta[n]).clone() for n in SHAPES}
    # the reference rows as a download leaves them in the snapshot (`shares`: the engine's own)
    engine = SyncEngine(CoordinatorClient("http://127.0.0.1:9", "t"), params, piece=piece, shares=mine)
    engine.take_delta()
    return engine


def pieces_and_whole(factor_of: float | None) -> tuple[np.ndarray, np.ndarray, float]:
    gen = torch.Generator().manual_seed(5)
    ref = {n: torch.rand(s, generator=gen) for n, s in SHAPES.items()}
    theta = {n: ref[n] - (torch.rand(s, generator=gen) - 0.5) * 0.6 for n, s in SHAPES.items()}
    fp = FixedPoint.plan(4, 0.5)
    masks = GroupMasks(2, fp, secrets.token_bytes(32), {1: secrets.token_bytes(32)})
    told = {"session": "ab" * 8, "weight": 0.5, "std": 0.0}
    engines = [rank_engine(k, ref, theta) for k in (0, 1)]
    total = sum(sent_square_norm(e) for e in engines)
    factor = 1.0 if factor_of is None else min(1.0, factor_of / math.sqrt(total))
    bodies = [masked_piece(e, masks, told, factor) for e in engines]
    delta = {n: ref[n] - theta[n] for n in SHAPES}
    if factor_of is not None:  # what the whole upload's DP path does: clip the whole, weight, encode with 1
        clipped, norm = clip_update(delta, factor_of)
        assert math.isclose(norm, math.sqrt(total), rel_tol=1e-6)  # the rows' norms make the whole's
        want = {n: masks.mask_rows(n, clipped[n].to(torch.float64) * 0.5, 1.0, 0) for n in SHAPES}
    else:
        want = {n: masks.mask_rows(n, delta[n], 0.5, 0) for n in SHAPES}
    got: dict[str, list[tuple[int, np.ndarray]]] = {}
    for body in bodies:
        ranges = json.loads(body.metadata[ROWS_META])
        for n, t in load(b"".join(bytes(c) for c in body)).items():
            got.setdefault(n, []).append((ranges[n][0], t.numpy()))
    joined = np.concatenate([np.concatenate([a for _, a in sorted(got[n], key=lambda p: p[0])]) for n in SHAPES])
    return joined, np.concatenate([want[n] for n in SHAPES]), factor


def test_two_ranks_pieces_are_the_whole_masked_upload() -> None:
    joined, want, _ = pieces_and_whole(None)
    assert np.array_equal(joined, want)


def test_with_dp_the_clip_is_over_the_assembled_update() -> None:
    joined, want, factor = pieces_and_whole(0.3)
    assert factor < 0.5  # the clip bites: each rank's rows alone are under C, the whole is not
    assert np.array_equal(joined, want)


class _Ranks:
    """A rank's worker channel as `exchange_masked_piece` sees it: rank 0's word is `said`."""

    def __init__(self, lead: bool, said: dict[str, Any] | None = None) -> None:
        self.lead, self.said = lead, said or {}
        self.sent: list[dict[str, Any]] = []

    def broadcast_json(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.sent.append(payload)
        return payload if self.lead else self.said


@pytest.mark.parametrize(("transient", "raised"), [(True, "CoordinatorUnavailable"), (False, "DistributedSyncError")])
def test_rank_0s_failed_join_fails_every_rank_alike_on_the_worker_thread(transient: bool, raised: str) -> None:
    """Overlapped: a rank > 0 learns that rank 0 could not join, and fails with an error a
    participant rides out exactly when rank 0's was one (a coordinator outage stays an outage on
    every rank, not a lasting failure that stops the group)."""
    from types import SimpleNamespace

    from fedtrain.participant.engine.outage import is_transient
    from fedtrain.participant.engine.secagg_pieces import exchange_masked_piece
    from tests.helpers.config import tiny_config

    cfg = tiny_config(privacy={"secure_aggregation": True, "dp": False})
    said = {"failed": True, "transient": transient, "told": None}
    with pytest.raises(Exception) as got:
        exchange_masked_piece(cast(Any, _Ranks(False, said)), cast(Any, SimpleNamespace(deltas=False)), 3, "g", cfg,
                              tokens=10)
    assert type(got.value).__name__ == raised and is_transient(got.value) is transient
    assert "rank 0 of this participant could not join round 3" in str(got.value)


def test_rank_0_tells_its_ranks_when_its_join_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's join fails: it still broadcasts (failed, transient) before raising, so no rank
    waits on a collective that will not come."""
    from types import SimpleNamespace

    import fedtrain.participant.engine.secagg_pieces as pieces
    from fedtrain.errors import CoordinatorUnavailable
    from tests.helpers.config import tiny_config

    def down(*args: object, **kwargs: object) -> None:
        raise CoordinatorUnavailable("no answer", status=0, code="unavailable")

    monkeypatch.setattr(pieces, "lead_join", down)
    ranks = _Ranks(True)
    with pytest.raises(CoordinatorUnavailable):
        pieces.exchange_masked_piece(cast(Any, ranks), cast(Any, SimpleNamespace(deltas=False)), 0, "g",
                                     tiny_config(privacy={"secure_aggregation": True, "dp": False}), tokens=10)
    assert ranks.sent == [{"failed": True, "transient": True, "told": None}]
