"""The coordinator's web routes without a browser: the page and its assets, the JSON
index, /v1/whoami, and Prometheus /metrics (token needed, figures follow the run)."""

from __future__ import annotations

import httpx

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.http.prometheus import CONTENT_TYPE
from tests.conftest import ATOKEN, PTOKEN
from tests.integration.test_api import put, zeros_like_model


def client(c: BackgroundCoordinator, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=c.url, headers=headers, timeout=30)


def test_page_assets_and_index(coordinator: BackgroundCoordinator) -> None:
    with client(coordinator, None) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        for asset in ("static/app.js", "static/charts.js", "static/format.js", "static/style.css"):
            assert asset in page.text
            r = http.get("/" + asset)
            assert r.status_code == 200 and len(r.content) > 500, asset
        assert "http://" not in page.text and "https://" not in page.text  # no CDN: it works offline
        missing = http.get("/static/nope.js")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        index = http.get("/v1").json()
        assert index["dashboard"] == "/" and index["metrics"] == "/metrics" and index["api"] == "/v1"
        assert http.get("/v1/whoami").status_code == 401
    with client(coordinator, PTOKEN) as http:
        assert http.get("/v1/whoami").json()["role"] == "participant"
    with client(coordinator, ATOKEN) as http:
        who = http.get("/v1/whoami").json()
        assert who["role"] == "admin" and who["server_time"] > 0


def metrics(http: httpx.Client) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in r.text.splitlines() if not line.startswith("#"))}


def test_prometheus_metrics_follow_the_run(coordinator: BackgroundCoordinator) -> None:
    with client(coordinator, None) as anonymous:
        r = anonymous.get("/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    with client(coordinator, PTOKEN) as http:
        m = metrics(http)
        assert m["fedtrain_rounds_committed_total"] == 0 and m['fedtrain_participants{state="active"}'] == 0
        assert http.post("/v1/join", json={"name": "a"}).status_code == 200
        assert put(http, 0, "a", zeros_like_model(coordinator)).status_code == 200
        http.get("/v1/rounds/0", params={"wait": 10})
        assert http.get("/v1/model").status_code == 200  # ends only once round 0 is committed
        m = metrics(http)
    assert m["fedtrain_rounds_committed_total"] == 1 and m["fedtrain_current_round"] == 1
    assert m['fedtrain_participants{state="active"}'] == 1
    assert m["fedtrain_bytes_received_total"] > 0
    assert m['fedtrain_round_duration_seconds_bucket{le="+Inf"}'] == 1 and m["fedtrain_merge_seconds_count"] == 1
    assert m['fedtrain_participant_tokens_total{participant="a"}'] == 100
    assert m["fedtrain_config_version"] == 1
