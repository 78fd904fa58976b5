"""Rows a participant can make the coordinator store: metric reports and the events its joins
and leaves write. Each table keeps its newest rows up to a cap (`store.MAX_METRIC_ROWS`,
`MAX_EVENT_ROWS`), so a participant that reports or rejoins for ever cannot fill the disk;
the newest rows, which the status, the dashboard and `fedtrain status` read, stay."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.state import store
from tests.helpers.api import client
from tests.helpers.config import tiny_config


def test_metric_and_event_rows_are_capped_keeping_the_newest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "MAX_METRIC_ROWS", 300)  # the cap's rule, at a size a test can reach
    monkeypatch.setattr(store, "MAX_EVENT_ROWS", 40)
    with BackgroundCoordinator(tmp_path / "state", tiny_config()) as c, client(c) as http:
        assert http.post("/v1/join", json={"name": "chatty"}).status_code == 200
        for i in range(20):  # 20 reports of 100 values: 2,000 rows asked for
            values = {f"m{k}": float(i) for k in range(100)}
            r = http.post("/v1/participants/chatty/metrics", json={"round": 0, "step": i, "values": values})
            assert r.status_code == 200, r.text
        for i in range(30):  # 60 events from joins and leaves under new names
            assert http.post("/v1/join", json={"name": f"p{i}"}).status_code == 200
            assert http.post(f"/v1/participants/p{i}/leave").status_code == 200
        kept = c.service.metrics(limit=10_000)
        assert len(kept) == 300
        assert {m["step"] for m in kept} == {17, 18, 19}  # the newest three reports, whole
        events = c.service.event_log(limit=10_000)
        assert len(events) == 40 and events[-1]["participant_id"] == "p29"  # the newest, in order
        assert http.get("/v1/status").status_code == 200  # and the run goes on
