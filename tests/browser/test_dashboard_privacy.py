"""The dashboard of a run with central DP: a Privacy card with ε after the committed rounds, δ and
the budget (hidden when the run has no DP); with secure aggregation, its phase in the open round."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from playwright.sync_api import expect

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.api import client, put, wait_round
from tests.helpers.browser import Page
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config

# xdist: one Chromium at a time on two cores (its waits are bounded)
pytestmark = pytest.mark.xdist_group("browser")
pytest.importorskip("dp_accounting")


def test_the_privacy_card_shows_epsilon_and_the_budget(page: Page, tmp_path: Path) -> None:
    cfg = tiny_config(rounds=3, privacy={"noise_multiplier": 2.0, "epsilon_budget": 40, "delta": 1e-6})
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        with client(c, ATOKEN) as http:
            http.post("/v1/join", json={"name": "a"})
            zeros = {n: torch.zeros_like(t) for n, t in c.service.inspect().weights.items()}
            assert put(http, 0, "a", zeros).status_code == 200
            wait_round(http, 0)
        eps = c.service.status()["privacy"]["epsilon"]
        pg = page.page
        pg.goto(f"{c.url}/#token={PTOKEN}")
        expect(pg.locator("body")).to_have_attribute("data-ready", "1")
        expect(pg.locator("#c-privacy-card")).to_be_visible()
        expect(pg.locator("#c-privacy-label")).to_have_text("Privacy (central DP)")
        expect(pg.locator("#c-privacy")).to_contain_text(f"ε {eps:.3f}"[:5])  # fmt.num: 4 significant digits
        expect(pg.locator("#c-privacy-sub")).to_contain_text("1 rounds · budget 40")
        pg.goto("about:blank")
    assert not page.errors, page.errors


def test_a_run_without_dp_shows_no_privacy_card(page: Page, tmp_path: Path) -> None:
    with BackgroundCoordinator(tmp_path / "state", tiny_config(rounds=1)) as c:
        pg = page.page
        pg.goto(f"{c.url}/#token={PTOKEN}")
        expect(pg.locator("body")).to_have_attribute("data-ready", "1")
        expect(pg.locator("#c-privacy-card")).to_be_hidden()
        pg.goto("about:blank")
    assert not page.errors, page.errors


def test_secure_aggregation_shows_its_phase_on_the_privacy_card(page: Page, tmp_path: Path) -> None:
    cfg = tiny_config(rounds=1, privacy={"dp": False, "secure_aggregation": True})
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        phase = c.service.status()["secure_aggregation"]["phase"]
        pg = page.page
        pg.goto(f"{c.url}/#token={PTOKEN}")
        expect(pg.locator("body")).to_have_attribute("data-ready", "1")
        expect(pg.locator("#c-privacy-card")).to_be_visible()
        expect(pg.locator("#c-privacy-label")).to_have_text("Privacy (secure aggregation)")
        expect(pg.locator("#c-privacy")).to_have_text(phase)
        expect(pg.locator("#c-privacy-sub")).to_contain_text(f"secure aggregation: round 0, {phase}, 0/0 uploaded")
        pg.goto("about:blank")
    assert not page.errors, page.errors
