"""The dashboard's participants table in balanced rounds: each participant's H for the open round,
with the reason the coordinator gave it."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import expect

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient
from tests.helpers.api import close_round
from tests.helpers.browser import ARTIFACTS, Page
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.tiny import Small, init_file

# xdist: one Chromium at a time on two cores (its waits are bounded)
pytestmark = pytest.mark.xdist_group("browser")


def test_the_table_shows_each_participants_h_and_why(page: Page, tmp_path: Path) -> None:
    cfg = tiny_config(rounds=0, train={"sync_every": 8}, schedule={"mode": "balanced"})
    with BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, Small())) as c, \
            CoordinatorClient(c.url, PTOKEN) as client:
        model = client.join("fast")["model"]
        client.join("slow")
        close_round(client, ["fast", "slow"], 0, model)
        client.heartbeat("fast", steps_per_s=4.0)
        client.heartbeat("slow", steps_per_s=1.0)
        told = {n: client.get_config(round_=1, participant_id=n)["assignment"] for n in ("fast", "slow")}
        pg = page.page
        pg.goto(f"{c.url}/#token={PTOKEN}")
        expect(pg.locator("body")).to_have_attribute("data-ready", "1")
        for name in ("fast", "slow"):
            cell = pg.locator(f'#participants tbody tr[data-pid="{name}"] td.told')
            expect(cell).to_contain_text(str(told[name]["sync_every"]))
            expect(cell.locator(".why")).to_have_text(told[name]["reason"])
        expect(pg.locator('#participants tbody tr[data-pid="slow"] td.told')).to_have_attribute(
            "title", told["slow"]["reason"])
        ARTIFACTS.mkdir(exist_ok=True)
        pg.locator("#participants").screenshot(path=str(ARTIFACTS / "dashboard-balanced.png"))
        pg.goto("about:blank")  # the page's event stream ends before the coordinator stops
    assert not page.errors, page.errors
