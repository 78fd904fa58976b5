"""An update that arrives in pieces (`coordinator/pieces.py`): several bodies, each holding some
tensors whole or a range of their rows, sent in any order and in parallel; the update counts
once they cover the sync set, and merges exactly as the same update sent whole."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.intake.pieces import ROWS_META
from fedtrain.wire import DIGEST_HEADER, EncodedBody
from fedtrain.wire.compress import compress
from tests.helpers.api import assert_error, client, deltas, halves, put, send_piece
from tests.helpers.config import tiny_config


def run_round(tmp_path: Path, in_pieces: bool, scheme: str) -> dict[str, torch.Tensor]:
    """q sends its update whole, then p its update whole or in two pieces sent at once from two
    threads (the second half first); the weights after the round."""
    with BackgroundCoordinator(tmp_path / f"{in_pieces}-{scheme}", tiny_config()) as c, \
            client(c) as http:
        for pid in ("p", "q"):
            assert http.post("/v1/join", json={"name": pid}).status_code == 200
        dp, dq = deltas(c, 1), deltas(c, 2)
        if scheme != "none":  # the whole update goes compressed too, with the same scheme
            sent, meta = compress(dq, scheme)
            enc = EncodedBody(sent, meta)
            r = http.put("/v1/rounds/0/updates/q", params={"tokens": 70}, content=b"".join(bytes(x) for x in enc),
                         headers={DIGEST_HEADER: enc.digest()})
        else:
            r = put(http, 0, "q", dq, tokens=70)
        assert r.json()["accepted"], r.text
        if not in_pieces:
            if scheme != "none":
                sent, meta = compress(dp, scheme)
                enc = EncodedBody(sent, meta)
                r = http.put("/v1/rounds/0/updates/p", params={"tokens": 30},
                             content=b"".join(bytes(x) for x in enc), headers={DIGEST_HEADER: enc.digest()})
            else:
                r = put(http, 0, "p", dp, tokens=30)
            assert r.json()["accepted"], r.text
        else:
            (t0, rows0), (t1, rows1) = halves(dp)
            answers: dict[str, dict] = {}

            def rank(label: str, tensors: dict[str, torch.Tensor], rows: dict[str, list[int]]) -> None:
                with client(c) as own:  # each rank its own connection
                    answers[label] = send_piece(own, "p", label, tensors, rows, tokens=30, scheme=scheme).json()

            threads = [threading.Thread(target=rank, args=("rank1", t1, rows1)),
                       threading.Thread(target=rank, args=("rank0", t0, rows0))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert all(a["accepted"] for a in answers.values()), answers
            assert sorted(a["complete"] for a in answers.values()) == [False, True]  # the last one completes it
        assert http.get("/v1/rounds/0", params={"wait": 20}).json()["state"] in ("closed", "committing")
        record = http.get("/v1/status").json()["recent_rounds"][0]
        assert record["n_submissions"] == 2 and {s["participant_id"] for s in record["submissions"]} == {"p", "q"}
        return {n: t.clone() for n, t in c.service.inspect().weights.items()}


@pytest.mark.parametrize("scheme", ["none", "bf16"])
def test_an_update_in_pieces_merges_exactly_as_the_whole_update(tmp_path: Path, scheme: str) -> None:
    whole = run_round(tmp_path, in_pieces=False, scheme=scheme)
    pieces = run_round(tmp_path, in_pieces=True, scheme=scheme)
    for name in whole:
        assert torch.equal(whole[name], pieces[name]), name


def test_pieces_are_checked_and_the_update_counts_only_once_they_cover_it(tmp_path: Path) -> None:
    with BackgroundCoordinator(tmp_path / "s", tiny_config()) as c, client(c) as http:
        for pid in ("p", "q"):
            http.post("/v1/join", json={"name": pid})
        (t0, rows0), (t1, rows1) = halves(deltas(c, 1))
        first = send_piece(http, "p", "r0", t0, rows0)
        assert first.status_code == 200, first.text
        got = first.json()
        assert got["complete"] is False and got["pieces"] == 1 and got["missing"]
        assert c.service.inspect().submitted == {}  # not an update yet
        # the same piece again is a duplicate; other bytes under its label are a conflict
        assert send_piece(http, "p", "r0", t0, rows0).json()["duplicate"] is True
        assert_error(send_piece(http, "p", "r0", {n: v + 1 for n, v in t0.items()}, rows0), 409, "piece_conflict")
        # a piece that overlaps one in, or claims other tokens, is refused
        assert_error(send_piece(http, "p", "again", t0, rows0), 409, "piece_overlaps")
        assert_error(send_piece(http, "p", "r1", t1, rows1, tokens=99), 400, "piece_mismatch")
        # rows outside the tensor or for a tensor it does not hold (400), a tensor the model lacks (422)
        name = next(n for n, rows in rows1.items())
        assert_error(send_piece(http, "p", "bad", {name: t1[name]}, {name: [rows1[name][0], 10**6]}), 400)
        assert_error(send_piece(http, "p", "bad", {name: t1[name]}, {name: rows1[name], "ghost": [0, 1]}), 400)
        assert_error(send_piece(http, "p", "bad", {"ghost": torch.zeros(2)}), 422, "incompatible_update")
        # a piece holding a NaN is refused (422) and named in an event; it takes no rows
        poisoned = {n: v.clone() for n, v in t1.items()}
        poisoned[name].view(-1)[0] = float("nan")
        assert_error(send_piece(http, "p", "r1", poisoned, rows1), 422, "non_finite")
        events = http.get("/v1/events").json()["events"]
        assert any(e["kind"] == "refuse" and "piece 'r1'" in e["message"] for e in events)
        # a whole upload that says it holds rows is a piece without its label
        enc = EncodedBody(t1, {ROWS_META: json.dumps(rows1)})
        r = http.put("/v1/rounds/0/updates/q", params={"tokens": 5}, content=b"".join(bytes(x) for x in enc),
                     headers={DIGEST_HEADER: enc.digest()})
        assert_error(r, 400)
        assert "?piece=" in r.json()["error"]["message"]
        assert c.service.inspect().submitted == {}
        last = send_piece(http, "p", "r1", t1, rows1).json()
        assert last["complete"] is True and last["pieces"] == 2 and last["missing"] == []
        assert c.service.inspect().submitted == {"p": 100}
        # pieces after the update is in are duplicates of it
        assert send_piece(http, "p", "r1", t1, rows1).json()["duplicate"] is True
        status = http.get("/v1/status").json()
        p = next(x for x in status["participants"] if x["id"] == "p")
        assert p["tokens"] == 100  # counted once, not per piece


def test_a_round_that_closes_drops_an_update_still_in_pieces(tmp_path: Path) -> None:
    cfg = tiny_config(min_participants=1, round_timeout_s=1.0)
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c) as http:
        for pid in ("p", "q"):
            http.post("/v1/join", json={"name": pid})
        (t0, rows0), (t1, rows1) = halves(deltas(c, 1))
        assert send_piece(http, "p", "r0", t0, rows0).json()["complete"] is False
        assert put(http, 0, "q", deltas(c, 2), tokens=10).json()["accepted"]
        assert http.get("/v1/rounds/0", params={"wait": 20}).json()["state"] in ("closed", "committing")
        record = http.get("/v1/status").json()["recent_rounds"][0]
        assert [s["participant_id"] for s in record["submissions"]] == ["q"]  # p's half update is not in it
        assert_error(send_piece(http, "p", "r1", t1, rows1), 409, "round_closed")
        # the next round starts from nothing: one piece is not an update
        assert send_piece(http, "p", "r1", t1, rows1, round_=1).json()["complete"] is False
        assert c.service.inspect().submitted == {}


def test_an_update_comes_in_a_bounded_number_of_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fedtrain.coordinator.intake.pieces.MAX_PIECES", 2)
    with BackgroundCoordinator(tmp_path / "s", tiny_config()) as c, client(c) as http:
        for pid in ("p", "q"):
            http.post("/v1/join", json={"name": pid})
        delta = deltas(c, 1)
        names = list(delta)
        for i, name in enumerate(names[:2]):
            assert send_piece(http, "p", f"t{i}", {name: delta[name]}).json()["complete"] is False
        err = assert_error(send_piece(http, "p", "t2", {names[2]: delta[names[2]]}), 400, "too_many_pieces")
        assert "send larger pieces" in err["message"]
        assert send_piece(http, "p", "t1", {names[1]: delta[names[1]]}).json()["duplicate"] is True  # not a new one
        rest = {n: delta[n] for n in names[2:]}
        assert_error(send_piece(http, "p", "rest", rest), 400, "too_many_pieces")
        assert c.service.inspect().submitted == {}


def test_a_piece_counts_as_in_while_its_complete_update_is_assembled(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the last piece and the update's place in the round, a rank asking after its piece
    (GET /v1/rounds/r?piece=) hears it is in, and a resend is a duplicate, not a new update."""
    from fedtrain.coordinator.intake import flow as intake

    entered, release = threading.Event(), threading.Event()
    real = intake.assemble

    def slow_assemble(*args: object) -> None:
        entered.set()
        assert release.wait(30)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(intake, "assemble", slow_assemble)
    with BackgroundCoordinator(tmp_path / "s", tiny_config(min_participants=2)) as c, client(c) as http:
        for pid in ("p", "q"):
            http.post("/v1/join", json={"name": pid})
        (t0, rows0), (t1, rows1) = halves(deltas(c, 1))
        assert send_piece(http, "p", "r0", t0, rows0).json()["complete"] is False
        last = threading.Thread(target=lambda: send_piece(client(c), "p", "r1", t1, rows1))
        last.start()
        assert entered.wait(30)
        try:
            info = http.get("/v1/rounds/0", params={"participant_id": "p", "piece": "r0", "wait": 0}).json()
            assert info["submitted"] is True, info
            again = send_piece(http, "p", "r0", t0, rows0).json()
            assert again["duplicate"] is True and again["piece"] == "r0", again
        finally:
            release.set()
            last.join(30)
        info = http.get("/v1/rounds/0", params={"participant_id": "p", "piece": "r0", "wait": 0}).json()
        assert info["submitted"] is True and c.service.inspect().submitted == {"p": 100}
        assert_error(http.get("/v1/rounds/0", params={"participant_id": "p", "piece": "bad label!"}), 400,
                     "invalid_piece")
