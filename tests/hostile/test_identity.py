"""What a participant says of itself at its join (`info`, issue 30 item 6): bounded in bytes,
keys and depth with a clear answer naming the field, written once (not by every heartbeat),
and not kept whole, or forever, once the participant has left."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.members import roster
from fedtrain.coordinator.members.processes import MAX_INFO_BYTES, MAX_INFO_DEPTH, MAX_INFO_KEYS
from tests.helpers.config import PTOKEN, tiny_config

AUTH = {"Authorization": f"Bearer {PTOKEN}"}


@contextlib.contextmanager
def coordinator(tmp_path: Path) -> Iterator[httpx.Client]:
    """A client of a coordinator over `tmp_path / "state"`."""
    with BackgroundCoordinator(tmp_path / "state", tiny_config()) as c, \
            httpx.Client(base_url=c.url, headers=AUTH, timeout=30) as http:
        yield http


def join(http: httpx.Client, name: str, info: dict[str, Any]) -> httpx.Response:
    return http.post("/v1/join", json={"name": name, "info": info, "key_cookie": False})


def as_(answer: httpx.Response) -> dict[str, str]:
    return {"X-Fedtrain-Participant-Key": answer.json()["participant_key"]}


def stored_info(tmp_path: Path) -> dict[str, int]:
    """The bytes of `info` each participant's row holds in run.db (read beside the coordinator)."""
    with contextlib.closing(sqlite3.connect(f"file:{tmp_path / 'state' / 'run.db'}?mode=ro", uri=True)) as db:
        return dict(db.execute("SELECT id, length(info) FROM participants").fetchall())


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"k": value}
    return value


@pytest.mark.parametrize("info, status, code", [
    ({"host": "x" * 900_000}, 413, "info_too_large"),  # 0.9 MB: under the body limit of control requests
    ({"host": "x" * MAX_INFO_BYTES}, 413, "info_too_large"),
    ({f"k{i}": i for i in range(MAX_INFO_KEYS + 1)}, 413, "info_too_large"),
    (nested(MAX_INFO_DEPTH + 1), 400, "invalid_info"),
], ids=["0.9MB", "just-over", "keys", "depth"])
def test_a_join_whose_info_is_too_large_is_refused_naming_the_field(
        tmp_path: Path, info: dict[str, Any], status: int, code: str) -> None:
    with coordinator(tmp_path) as http:
        r = join(http, "big", info)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["code"] == code and error["details"]["field"] == "info" and "info" in error["message"]
        assert "big" not in stored_info(tmp_path)  # nothing kept of it
        assert join(http, "fine", {"host": "h", "parallel": "ddp", "world_size": 2}).status_code == 200
        assert join(http, "deep-enough", nested(MAX_INFO_DEPTH)).status_code == 200  # the bounds are inclusive


def test_departed_participants_keep_only_what_the_status_shows(tmp_path: Path) -> None:
    """50 joins and departures with 15 KiB of info each used to leave 750 KB in run.db for good."""
    info = {"host": "h", "parallel": "ddp", "world_size": 2, "notes": "x" * (15 << 10)}
    with coordinator(tmp_path) as http:
        for i in range(50):
            r = join(http, f"p{i}", info)
            assert r.status_code == 200
            assert http.post(f"/v1/participants/p{i}/leave", headers=as_(r)).status_code == 200
        held = sum(stored_info(tmp_path).values())
        shown = {p["id"]: p for p in http.get("/v1/status").json()["participants"]}
    assert held < 50 * 200, f"{held} bytes of info kept for 50 departed participants"
    assert shown["p7"]["state"] == "left" and (shown["p7"]["parallel"], shown["p7"]["world_size"]) == ("ddp", 2)


def test_only_so_many_departed_participants_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roster, "MAX_DEPARTED", 5)
    with coordinator(tmp_path) as http:
        stays = join(http, "stays", {})
        for i in range(12):
            r = join(http, f"p{i}", {})
            assert http.post(f"/v1/participants/p{i}/leave", headers=as_(r)).status_code == 200
        shown = {p["id"]: p["state"] for p in http.get("/v1/status").json()["participants"]}
        rows = stored_info(tmp_path)
        # the newest five departures and the active one, in the status and in run.db alike
        assert shown == {"stays": "active", **{f"p{i}": "left" for i in range(7, 12)}} and set(rows) == set(shown)
        assert join(http, "p0", {}).status_code == 200  # a forgotten name may join again
        beat = http.post("/v1/participants/stays/heartbeat", json={"step": 1}, headers=as_(stays))
        assert beat.status_code == 200  # the run goes on


def test_heartbeats_leave_the_info_of_the_join_as_it_was(tmp_path: Path) -> None:
    info = {"host": "h", "parallel": "fsdp", "world_size": 4, "notes": "x" * 1000}
    with coordinator(tmp_path) as http:
        r = join(http, "a", info)
        before = stored_info(tmp_path)["a"]
        for step in range(5):
            beat = http.post("/v1/participants/a/heartbeat", json={"step": step}, headers=as_(r))
            assert beat.status_code == 200
        (shown,) = http.get("/v1/status").json()["participants"]
        assert stored_info(tmp_path)["a"] == before and shown["step"] == 4
        assert (shown["parallel"], shown["world_size"]) == ("fsdp", 4)
