"""The dashboard's site tokens panel (issue 31) in headless Chromium: the admin mints a site's
token (shown once, and it joins), sees who joined with each token, and revokes one (refused from
then on); a participant token sees no panel and never asks for the tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Dialog, expect

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.browser import Page
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config

pytestmark = pytest.mark.xdist_group("browser")


@pytest.fixture()
def coordinator(tmp_path: Path) -> Iterator[BackgroundCoordinator]:
    with BackgroundCoordinator(tmp_path / "state", tiny_config(rounds=0)) as c:
        yield c


def test_admin_mints_and_revokes_a_site_token_from_the_dashboard(page: Page,
                                                                 coordinator: BackgroundCoordinator) -> None:
    pg = page.page
    pg.goto(f"{coordinator.url}/#token={ATOKEN}")
    expect(pg.locator("#tokens-panel")).to_be_visible()
    expect(pg.locator("#tokens tbody tr")).to_have_count(1)  # the token given at start
    pg.fill("#mint-name", "site-z")
    pg.click("#mint-go")
    expect(pg.locator("#minted")).to_be_visible()
    token = pg.locator("#minted-token").inner_text().strip()
    with httpx.Client(base_url=coordinator.url, headers={"Authorization": f"Bearer {token}"}) as site:
        assert site.post("/v1/join", json={"name": "z1"}).status_code == 200
        row = pg.locator("#tokens tbody tr", has_text="site-z")
        expect(row).to_contain_text("z1", timeout=20_000)  # the panel refreshes on its own
        pg.once("dialog", lambda d: Dialog.accept(d))
        row.locator("button[data-revoke]").click()
        expect(row).to_contain_text("revoked")
        expect(pg.locator("#tokens-result")).to_contain_text("evicted: z1")
        assert site.get("/v1/status").json()["error"]["code"] == "token_revoked"
    assert not page.errors, page.errors


def test_a_participant_token_sees_no_tokens_panel(page: Page, coordinator: BackgroundCoordinator) -> None:
    pg = page.page
    asked: list[str] = []
    pg.on("request", lambda r: asked.append(r.url) if "/v1/admin/tokens" in r.url else None)
    pg.goto(f"{coordinator.url}/#token={PTOKEN}")
    expect(pg.locator("#role")).to_have_text("participant")
    expect(pg.locator("#tokens-panel")).to_be_hidden()
    assert asked == []
