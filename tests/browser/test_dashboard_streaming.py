"""The dashboard of a Streaming DiLoCo run: K in the run's name, the open round's fragment, and
a Fragment column in the rounds table (hidden when the run does not stream)."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import expect

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.browser import ARTIFACTS, Page
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.runs import FRAGMENTS, initial_model
from tests.helpers.tiny import Regression, TinyParticipant, init_file, run_all

# xdist: one Chromium at a time on two cores (its waits are bounded)
pytestmark = pytest.mark.xdist_group("browser")


def test_the_rounds_table_shows_the_fragment_each_round_synced(page: Page, tmp_path: Path) -> None:
    cfg = tiny_config(rounds=4, train={"sync_every": 4}, min_participants=2,
                      streaming={"fragments": 2, "assign": FRAGMENTS, "overlap": 1, "alpha": 0.5})
    with BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, initial_model())) as c:
        run_all([TinyParticipant(c.url, f"p{i}", Regression(rows=8, seed=60 + i)) for i in range(2)])
        pg = page.page
        pg.goto(f"{c.url}/#token={PTOKEN}")
        expect(pg.locator("body")).to_have_attribute("data-ready", "1")
        expect(pg.locator("#run-name")).to_contain_text("streaming, K = 2 fragments")
        header = pg.locator("#rounds thead th.fragment-col")
        expect(header).to_be_visible()
        for r in range(4):
            expect(pg.locator(f'#rounds tbody tr[data-round="{r}"] td.fragment-col')).to_have_text(str(r % 2))
        ARTIFACTS.mkdir(exist_ok=True)
        pg.locator("#rounds").screenshot(path=str(ARTIFACTS / "dashboard-streaming.png"))
        pg.goto("about:blank")  # the page's event stream ends before the coordinator stops
    assert not page.errors, page.errors


def test_a_run_without_streaming_shows_no_fragment_column(page: Page, tmp_path: Path) -> None:
    with BackgroundCoordinator(tmp_path / "state", tiny_config(rounds=1),
                               init_weights=init_file(tmp_path, initial_model())) as c:
        pg = page.page
        pg.goto(f"{c.url}/#token={PTOKEN}")
        expect(pg.locator("body")).to_have_attribute("data-ready", "1")
        expect(pg.locator("#rounds thead th.fragment-col")).to_be_hidden()
        expect(pg.locator("#run-name")).not_to_contain_text("streaming")
        pg.goto("about:blank")
    assert not page.errors, page.errors
