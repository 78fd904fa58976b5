"""Masked pieces from a hostile participant (`coordinator/intake/masked_pieces.py`): a piece in the
wrong dtype, with element ranges out of the tensor or overlapping a piece in, of another session,
compressed, claiming other tokens, or one too many is refused (4xx) before it counts, and nothing
changes: no piece is held for it, nothing is in the ring sum, and the honest pieces still make the
update, which merges exactly as if the refused ones had never come."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.intake.pieces import MAX_PIECES
from fedtrain.privacy.round_setup import SECAGG_META
from fedtrain.wire.format import ROWS_META
from tests.helpers.api import client
from tests.helpers.config import ATOKEN, tiny_config
from tests.helpers.secagg import Piece, Site, ok, reveal_and_commit, run_to_upload

pytest.importorskip("cryptography")

RANGE = 0.5
SECAGG = {"secure_aggregation": True, "dp": False, "secagg_max_participants": 4, "secagg_range": RANGE}
TOKENS = {"a": 100, "g": 100}


def refused(r: object, status: int, code: str | None = None) -> None:
    assert r.status_code == status, r.text  # type: ignore[attr-defined]
    if code is not None:
        assert r.json()["error"]["code"] == code, r.text  # type: ignore[attr-defined]


def unchanged(c: BackgroundCoordinator, labels: list[str]) -> None:
    """Only the pieces `labels` of g's update are held, and nothing of g is in the ring sum."""
    status = c.service.status()
    assert status["secure_aggregation"]["uploaded"] == 1  # a's whole upload only
    for label in ("rank0", "rank1", "bad"):
        assert c.service.has_piece("g", 0, label) == (label in labels), label


def with_meta(g: Site, piece: Piece, **changes: object) -> dict[str, str]:
    about = {"session": g.session, "bits": 16, **changes}
    return {SECAGG_META: json.dumps(about), ROWS_META: json.dumps(piece[1])}


def coordinator(tmp_path: Path) -> BackgroundCoordinator:
    return BackgroundCoordinator(tmp_path / "s", tiny_config(outer={"algorithm": "fedavg"}, privacy=SECAGG))


def test_hostile_masked_pieces_are_refused_and_change_nothing(tmp_path: Path) -> None:
    with coordinator(tmp_path) as c, client(c, ATOKEN) as http:
        before = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        for pid in TOKENS:
            ok(http.post("/v1/join", json={"name": pid}))
        g_ = torch.Generator().manual_seed(3)
        ds = {pid: {n: (torch.rand(t.shape, generator=g_) - 0.5) * 0.4 for n, t in before.items()} for pid in TOKENS}
        a, g = sites = [Site(http, pid) for pid in TOKENS]
        run_to_upload(sites, TOKENS)
        ok(a.upload(a.masked(ds["a"]), TOKENS["a"]))
        first, second = g.masked_pieces(ds["g"])
        name = next(iter(first[0]))
        lo, hi = first[1][name]

        floats = ({n: t.to(torch.float32) for n, t in first[0].items()}, first[1])  # unmasked-looking: refused
        refused(g.upload_piece("bad", floats, TOKENS["g"]), 422, "incompatible_update")
        big = before[name].numel()  # a range past the tensor's last element
        past = ({**first[0], name: torch.zeros(7, dtype=torch.uint16)}, {**first[1], name: [big - 3, big + 4]})
        refused(g.upload_piece("bad", past, TOKENS["g"]), 400, "invalid_body")
        empty = ({**first[0], name: torch.zeros(0, dtype=torch.uint16)}, {**first[1], name: [lo, lo]})
        refused(g.upload_piece("bad", empty, TOKENS["g"]), 400, "invalid_body")
        shape = ({**first[0], name: first[0][name][:-1]}, first[1])  # fewer values than its range says
        refused(g.upload_piece("bad", shape, TOKENS["g"]), 422, "incompatible_update")
        other = with_meta(g, first, session="0" * 16)  # another attempt's session
        refused(g.upload_piece("bad", first, TOKENS["g"], meta=other), 400, "invalid_body")
        no_session = {ROWS_META: json.dumps(first[1])}
        refused(g.upload_piece("bad", first, TOKENS["g"], meta=no_session), 400, "invalid_body")
        compressed = {**with_meta(g, first), "fedtrain.compression": "int8"}
        assert g.upload_piece("bad", first, TOKENS["g"], meta=compressed).status_code in (400, 422)
        refused(g.upload_piece("bad", first, TOKENS["g"] + 1), 400, "secagg_tokens")  # not its claim
        refused(g.upload_piece("bad/..", first, TOKENS["g"]), 422)
        unchanged(c, [])

        ok(g.upload_piece("rank0", first, TOKENS["g"]))
        overlap = ({name: torch.zeros(2, dtype=torch.uint16)}, {name: [hi - 1, hi + 1]})
        refused(g.upload_piece("bad", overlap, TOKENS["g"]), 409, "piece_overlaps")
        refused(g.upload_piece("rank0", second, TOKENS["g"]), 409, "piece_conflict")  # other bytes, same label
        unchanged(c, ["rank0"])

        ok(g.upload_piece("rank1", second, TOKENS["g"]))  # the honest pieces still make the update
        reveal_and_commit(c, sites, 1)
        after = c.service.inspect().weights
    unit = RANGE / (2**13 - 1)
    for n, t in after.items():
        want = before[n] - (ds["a"][n] + ds["g"][n]) / 2
        assert torch.allclose(t, want, rtol=0, atol=2 * unit / 2 + 1e-6), n


def test_one_piece_too_many_is_refused(tmp_path: Path) -> None:
    """A group may send its update in up to MAX_PIECES pieces; the next one that does not complete
    it is refused (400 too_many_pieces), and its pieces in stay as they were."""
    with coordinator(tmp_path) as c, client(c, ATOKEN) as http:
        before = {n: t.clone() for n, t in c.service.inspect().weights.items()}
        for pid in TOKENS:
            ok(http.post("/v1/join", json={"name": pid}))
        a, g = sites = [Site(http, pid) for pid in TOKENS]
        run_to_upload(sites, TOKENS)
        zeros = {n: torch.zeros_like(t) for n, t in before.items()}
        ok(a.upload(a.masked(zeros), TOKENS["a"]))
        (tensors, ranges), _ = g.masked_pieces(zeros)
        name = max(before, key=lambda n: before[n].numel())
        assert before[name].numel() > MAX_PIECES
        values = tensors[name]
        for k in range(MAX_PIECES):  # one element each: far from covering the update
            lo = ranges[name][0] + k
            ok(g.upload_piece(f"p{k}", ({name: values[k:k + 1]}, {name: [lo, lo + 1]}), TOKENS["g"]))
        lo = ranges[name][0] + MAX_PIECES
        refused(g.upload_piece("one-more", ({name: values[MAX_PIECES:MAX_PIECES + 1]}, {name: [lo, lo + 1]}),
                               TOKENS["g"]), 400, "too_many_pieces")
        assert c.service.has_piece("g", 0, "p0") and not c.service.has_piece("g", 0, "one-more")
        assert c.service.status()["secure_aggregation"]["uploaded"] == 1
