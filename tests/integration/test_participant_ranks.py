"""The coordinator's view of a participant's processes (`coordinator/ranks.py`): how it trains
(one process, a DDP or FSDP group) and on how many ranks, in the status, `fedtrain status`
and `/metrics`, with the open round's update of a participant that sends it in pieces; a
malformed value is refused at the join, and one already stored reads as unknown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from fedtrain.cli.report import format_status
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.state.store import Store
from tests.helpers.api import assert_error, client, deltas, halves, put, send_piece
from tests.helpers.api import metrics as scrape
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.processes import fedtrain


def participants(http: httpx.Client) -> dict[str, dict[str, Any]]:
    return {p["id"]: p for p in http.get("/v1/status").json()["participants"]}


def header(text: str) -> str:
    """The participants table's header line in `fedtrain status`' text."""
    return next(line for line in text.splitlines() if line.startswith("participant "))


def line_of(text: str, pid: str) -> str:
    """The participants table's line of `pid` in `fedtrain status`' text."""
    return next(line for line in text.splitlines() if line.startswith(pid + " "))


def test_the_status_shows_each_participants_ranks_and_its_update_in_pieces(tmp_path: Path) -> None:
    with BackgroundCoordinator(tmp_path / "s", tiny_config()) as c, client(c) as http:
        joins = {"fsdp-a": {"parallel": "fsdp", "world_size": 2}, "ddp-b": {"parallel": "ddp", "world_size": 4},
                 "one-c": {}, "recipe-d": {"world_size": 1, "host": "x"}}
        for pid, info in joins.items():
            assert http.post("/v1/join", json={"name": pid, "info": info}).status_code == 200
        seen = {pid: (p["parallel"], p["world_size"], p["pieces"]) for pid, p in participants(http).items()}
        assert seen == {"fsdp-a": ("fsdp", 2, None), "ddp-b": ("ddp", 4, None), "one-c": ("single", 1, None),
                        "recipe-d": ("single", 1, None)}
        text = format_status(http.get("/v1/status").json())
        assert "pieces" not in header(text)  # no column for pieces while no update comes in them
        assert line_of(text, "fsdp-a").split()[2] == "fsdp×2" and line_of(text, "ddp-b").split()[2] == "ddp×4"
        assert line_of(text, "one-c").split()[2] == "1" and line_of(text, "recipe-d").split()[2] == "1"
        metrics = scrape(http)
        assert metrics['fedtrain_participant_world_size{participant="fsdp-a",parallel="fsdp"}'] == 2
        assert metrics['fedtrain_participant_world_size{participant="ddp-b",parallel="ddp"}'] == 4
        assert metrics['fedtrain_participant_world_size{participant="one-c",parallel="single"}'] == 1

        # the FSDP group's ranks send their pieces: the first is shown as 1 of 2, then the update is whole
        (t0, rows0), (t1, rows1) = halves(deltas(c, 1))
        assert send_piece(http, "fsdp-a", "rank0", t0, rows0).json()["complete"] is False
        status = http.get("/v1/status").json()
        got = next(p for p in status["participants"] if p["id"] == "fsdp-a")["pieces"]
        assert got["received"] == 1 and got["labels"] == ["rank0"] and got["complete"] is False
        assert 0 < got["covered"] < 1
        assert all(p["pieces"] is None for p in status["participants"] if p["id"] != "fsdp-a")
        text = format_status(status)
        assert header(text).endswith("pieces (this round)")
        assert f"1/2 ({got['covered']:.0%})" in line_of(text, "fsdp-a")
        printed = fedtrain("status", "--coordinator", c.url, "--token", PTOKEN)  # the command itself
        assert printed.returncode == 0, printed.stderr
        assert line_of(printed.stdout, "fsdp-a").split()[2] == "fsdp×2" and "1/2 (" in line_of(printed.stdout, "fsdp-a")
        assert send_piece(http, "fsdp-a", "rank1", t1, rows1).json()["complete"] is True
        assert participants(http)["fsdp-a"]["pieces"] == {"received": 2, "labels": ["rank0", "rank1"],
                                                          "covered": 1.0, "complete": True}
        assert line_of(format_status(http.get("/v1/status").json()), "fsdp-a").endswith("2/2 complete")

        # the round closes: the next one starts with no update in pieces
        for i, pid in enumerate(("ddp-b", "one-c", "recipe-d")):
            assert put(http, 0, pid, deltas(c, 2 + i), tokens=10).json()["accepted"]
        assert http.get("/v1/rounds/0", params={"wait": 20}).json()["state"] in ("closed", "committing")
        after = http.get("/v1/status").json()
        assert after["current_round"] == 1 and all(p["pieces"] is None for p in after["participants"])
        assert "pieces" not in header(format_status(after))


def test_a_malformed_parallel_or_world_size_is_refused_at_the_join(tmp_path: Path) -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"parallel": "mpi"}, "info.parallel must be one of 'single', 'ddp', 'fsdp'"),
        ({"parallel": 3}, "info.parallel"),
        ({"parallel": ["fsdp"]}, "info.parallel"),
        ({"parallel": "x" * 5000}, "info.parallel"),
        ({"world_size": 0}, "info.world_size must be a whole number of ranks from 1 to"),
        ({"world_size": -2}, "info.world_size"),
        ({"world_size": "2"}, "info.world_size"),
        ({"world_size": True}, "info.world_size"),
        ({"world_size": 2.0}, "info.world_size"),
        ({"world_size": 1 << 40}, "info.world_size"),
        ({"parallel": "fsdp", "world_size": {"ranks": 2}}, "info.world_size"),
        ({"parallel": "single", "world_size": 4}, "say 'ddp' or 'fsdp' for a torchrun group"),
    ]
    with BackgroundCoordinator(tmp_path / "s", tiny_config()) as c, client(c) as http:
        for info, said in bad:
            err = assert_error(http.post("/v1/join", json={"name": "bad", "info": info}), 400, "invalid_info")
            assert said in err["message"] and len(err["message"]) < 200, (info, err)
            assert err["details"]["field"] in ("info.parallel", "info.world_size")
        assert participants(http) == {}  # none of them joined
        # a rejoin with a bad value is refused too, and the row keeps what it said before
        ddp = {"parallel": "ddp", "world_size": 2}
        assert http.post("/v1/join", json={"name": "ok", "info": ddp}).status_code == 200
        assert_error(http.post("/v1/join", json={"name": "ok", "info": {"parallel": "DDP"}}), 400, "invalid_info")
        assert (participants(http)["ok"]["parallel"], participants(http)["ok"]["world_size"]) == ("ddp", 2)
        # say "fsdp" or "ddp" without the ranks: shown without a count
        assert http.post("/v1/join", json={"name": "some", "info": {"parallel": "fsdp"}}).status_code == 200
        assert line_of(format_status(http.get("/v1/status").json()), "some").split()[2] == "fsdp"


def test_a_stored_info_that_cannot_be_read_shows_as_unknown(tmp_path: Path) -> None:
    """Rows joined before the checks (or written by another version) may hold anything: the
    status, `fedtrain status` and `/metrics` show it as unknown, and never fail on it."""
    state = tmp_path / "s"
    with BackgroundCoordinator(state, tiny_config()) as c, client(c) as http:
        for pid in ("odd", "huge", "many", "listed"):
            assert http.post("/v1/join", json={"name": pid}).status_code == 200
    store = Store(state / "run.db")
    stored = {"odd": {"parallel": ["x"], "world_size": "lots"}, "huge": {"parallel": "ddp", "world_size": 10**12},
              "many": {"world_size": 8}, "listed": [1, 2]}
    for row in store.participants():
        row.info = stored[row.id]  # type: ignore[assignment]
        store.upsert_participant(row)
    store.close()
    with BackgroundCoordinator(state, tiny_config()) as c, client(c) as http:
        status = http.get("/v1/status")
        assert status.status_code == 200
        seen = {p["id"]: (p["parallel"], p["world_size"]) for p in status.json()["participants"]}
        assert seen == {"odd": (None, None), "huge": ("ddp", None), "many": (None, 8), "listed": (None, None)}
        text = format_status(status.json())
        labels = {pid: line_of(text, pid).split()[2] for pid in seen}
        assert labels == {"odd": "?", "huge": "ddp", "many": "?×8", "listed": "?"}
        metrics = scrape(http)
        assert metrics['fedtrain_participant_world_size{participant="many",parallel="unknown"}'] == 8
        assert not any('participant="odd"' in k for k in metrics if k.startswith("fedtrain_participant_world_size"))


def test_the_control_channel_is_a_gloo_group_of_its_own() -> None:
    """Two ranks: the control collectives agree, on a group that is not the training group."""
    from tests.helpers.torchrun import launch

    group = launch(str(Path(__file__).resolve().parents[1] / "helpers" / "workers" / "control_worker.py"))
    out, _ = group.communicate(timeout=120)
    assert group.returncode == 0, out[-3000:]
    assert out.count("control ok") == 2, out[-3000:]
