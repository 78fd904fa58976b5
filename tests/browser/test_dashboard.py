"""The dashboard in headless Chromium against a live run: the page fills from the API and
the SSE stream, a config change made in the form reaches every participant at one round
boundary, an invalid change shows its error and changes nothing, participant tokens get a
read-only view, an admin can evict, and the event log filters by kind."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import httpx
from playwright.sync_api import expect

from tests.browser.conftest import ARTIFACTS, SITES, LiveRun, Page
from tests.conftest import ATOKEN, PTOKEN


def open_dashboard(p: Page, run: LiveRun, token: str) -> None:
    p.page.goto(f"{run.url}/#token={token}")
    expect(p.page.locator("#participants tbody tr")).to_have_count(len(SITES))
    expect(p.page.locator("body")).to_have_attribute("data-ready", "1")


def wait_for(condition: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_page_loads_and_fills_from_a_live_run(page: Page, live_run: LiveRun) -> None:
    pg = page.page
    open_dashboard(page, live_run, ATOKEN)
    assert "token" not in pg.url  # the token is taken out of the address bar
    expect(pg.locator("#role")).to_have_text("admin")
    expect(pg.locator("#conn")).to_have_attribute("data-state", "live")
    expect(pg.locator("#run-name")).to_have_text("browser-test")
    for name in SITES:
        row = pg.locator(f'#participants tbody tr[data-pid="{name}"]')
        expect(row).to_have_attribute("data-state", "active")
        expect(row.locator("td.cfg")).to_have_text("v1")
        expect(row.locator("button[data-evict]")).to_be_visible()
    # charts: one training-loss line per participant, before and after lines per participant
    expect(pg.locator("#chart-train path.series")).to_have_count(len(SITES))
    expect(pg.locator("#chart-eval path.series")).to_have_count(2 * len(SITES))
    # the round timeline follows the run live (SSE): new rounds appear without a reload
    first = int(pg.locator("#rounds tbody tr[data-round]").first.get_attribute("data-round") or -1)
    expect(pg.locator("#rounds tbody tr[data-round]").first).not_to_have_attribute("data-round", str(first))
    expect(pg.locator("#rounds tbody tr[data-round]").first.locator(".chip")).to_have_count(len(SITES))
    expect(pg.locator("#events li[data-kind=join]")).to_have_count(len(SITES))
    expect(pg.locator("#events li[data-kind=round]").first).to_contain_text("closed")
    assert not page.errors, page.errors


def test_invalid_change_shows_its_error_and_applies_nothing(page: Page, live_run: LiveRun) -> None:
    pg = page.page
    open_dashboard(page, live_run, ATOKEN)
    validation, apply = pg.locator("#config-validation"), pg.locator("#config-apply")
    pg.fill("#f-train-sync_every", "0")
    expect(validation).to_have_attribute("data-state", "invalid")
    expect(validation).to_contain_text("train.sync_every")
    expect(validation).to_contain_text("greater than or equal to 1")
    expect(apply).to_be_disabled()
    pg.fill("#config-patch", '{"model": {"n_layer": 7}}')
    expect(validation).to_contain_text("model.n_layer cannot change during a run")
    expect(apply).to_be_disabled()
    expect(pg.locator("#f-train-sync_every")).to_have_value("")  # the form follows the JSON
    pg.fill("#config-patch", '{"train": {"sync_every": ')
    expect(validation).to_contain_text("Not valid JSON")
    expect(apply).to_be_disabled()
    pg.fill("#config-patch", '{"train": {"lr": -1}}')
    expect(validation).to_contain_text("train.lr")
    expect(apply).to_be_disabled()
    store = live_run.coordinator.service.store
    assert store.latest_config()[0] == 1 and len(store.config_history()) == 1  # type: ignore[index]
    assert all(fed.config_version == 1 for fed in live_run.feds.values())
    assert not page.errors, page.errors


def test_config_change_in_the_form_reaches_every_participant(page: Page, live_run: LiveRun) -> None:
    pg = page.page
    open_dashboard(page, live_run, ATOKEN)
    pg.fill("#f-train-sync_every", "7")
    pg.fill("#f-train-lr", "0.001")
    validation = pg.locator("#config-validation")
    expect(validation).to_have_attribute("data-state", "valid")
    expect(validation).to_contain_text("train.sync_every 5 → 7")
    expect(validation).to_contain_text("train.lr 0.003 → 0.001")
    pg.click("#config-apply")
    expect(pg.locator("#config-result")).to_contain_text(re.compile(r"Accepted as v2, in force (from round \d+|now)"))
    expect(pg.locator("#config-patch")).to_have_value("{}")
    [latest, *_] = live_run.coordinator.service.store.config_history()
    assert latest["version"] == 2 and latest["author"] == "admin"
    assert latest["diff"] == {"train.lr": [0.003, 0.001], "train.sync_every": [5, 7]}
    effective = latest["effective_round"]

    feds = live_run.feds
    wait_for(lambda: all(f.config_version == 2 and len(f.history) > 0 and f.history[-1]["round"] >= effective
                         for f in feds.values()), what="every participant to run config v2")
    for name, fed in feds.items():
        assert fed.config.train.sync_every == 7 and fed.config.train.lr == 0.001, name
        assert live_run.optimizers[name].param_groups[0]["lr"] == 0.001, name
        for rec in fed.history:  # everyone switched at the same round boundary
            assert rec["sync_every"] == (7 if rec["round"] >= effective else 5), (name, rec)
    # the dashboard shows the version each participant acknowledged, live
    for name in SITES:
        expect(pg.locator(f'#participants tbody tr[data-pid="{name}"] td.cfg')).to_have_text("v2")
    expect(pg.locator("#config-versions")).to_have_text("v2 in force")
    expect(pg.locator("#config-history li")).to_have_count(2)
    expect(pg.locator("#events li[data-kind=config]").first).to_contain_text("in force from round")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    pg.screenshot(path=str(shot), full_page=True)
    print(f"dashboard screenshot: {shot}")
    assert shot.stat().st_size > 10_000
    assert not page.errors, page.errors


def test_participant_token_gets_a_read_only_view(page: Page, live_run: LiveRun) -> None:
    pg = page.page
    pg.goto(f"{live_run.url}/#token=not-a-token")
    expect(pg.locator("#login-error")).to_have_text("That is not a token of this run.")
    pg.fill("#token-input", PTOKEN)
    pg.click("#login-form button[type=submit]")
    expect(pg.locator("#participants tbody tr")).to_have_count(len(SITES))
    expect(pg.locator("#role")).to_have_text("participant")
    expect(pg.locator("#readonly-note")).to_be_visible()
    expect(pg.locator("#config-editor")).to_be_hidden()
    expect(pg.locator("#config-json")).to_contain_text('"sync_every"')
    expect(pg.locator("button[data-evict]")).to_have_count(0)
    # the token was kept: a reload signs in again without asking
    pg.reload()
    expect(pg.locator("#role")).to_have_text("participant")
    ARTIFACTS.mkdir(exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / "dashboard-readonly.png"), full_page=True)
    assert not [e for e in page.errors if "401" not in e], page.errors  # the refused token logs one 401


def test_admin_evicts_from_the_dashboard(page: Page, live_run: LiveRun) -> None:
    pg = page.page
    with httpx.Client(base_url=live_run.url, headers={"Authorization": f"Bearer {PTOKEN}"}) as http:
        assert http.post("/v1/join", json={"name": "ghost"}).status_code == 200
    pg.goto(f"{live_run.url}/#token={ATOKEN}")
    row = pg.locator('#participants tbody tr[data-pid="ghost"]')
    expect(row).to_have_attribute("data-state", "active")
    row.locator("button[data-evict]").click()
    expect(row.locator("button[data-evict]")).to_have_text("Confirm evict")
    row.locator("button[data-evict]").click()
    expect(row).to_have_attribute("data-state", "evicted")
    expect(pg.locator("#events li[data-kind=evict]")).to_contain_text("ghost evicted by an admin")
    assert live_run.coordinator.service.participants["ghost"].state == "evicted"
    assert not page.errors, page.errors


def test_event_log_filters_by_kind_and_keeps_the_choice(page: Page, live_run: LiveRun) -> None:
    pg = page.page
    pg.goto(f"{live_run.url}/#token={ATOKEN}")  # not open_dashboard: an earlier test may have added a participant
    expect(pg.locator("body")).to_have_attribute("data-ready", "1")
    rows, chips = pg.locator("#events li"), pg.locator("#events-filter button")
    expect(pg.locator('#events-filter button[data-kind="all"]')).to_have_attribute("aria-pressed", "true")
    expect(pg.locator("#events li[data-kind=round]").first).to_be_visible()  # "all" is the default
    join = pg.locator('#events-filter button[data-kind="join"]')
    expect(join.locator(".ev-chip-count")).to_have_text(re.compile(r"^\d+$"))
    join.click()
    expect(join).to_have_attribute("aria-pressed", "true")
    wait_for(lambda: rows.count() == int(join.locator(".ev-chip-count").inner_text()), 30, "the join rows alone")
    assert rows.count() >= len(SITES)
    assert set(rows.evaluate_all("els => els.map(e => e.dataset.kind)")) == {"join"}
    # rounds keep closing: their events arrive (the "all" count grows) but stay out of the list
    everything = chips.filter(has=pg.locator(".ev-chip-label", has_text=re.compile("^all$")))
    before = int(everything.locator(".ev-chip-count").inner_text())
    wait_for(lambda: int(everything.locator(".ev-chip-count").inner_text()) > before, 60, "a new round event")
    assert set(rows.evaluate_all("els => els.map(e => e.dataset.kind)")) == {"join"}
    # the choice is kept in the page's storage: a reload shows the same filter
    pg.reload()
    expect(pg.locator("body")).to_have_attribute("data-ready", "1")
    expect(join).to_have_attribute("aria-pressed", "true")
    expect(rows.first).to_have_attribute("data-kind", "join")
    assert set(rows.evaluate_all("els => els.map(e => e.dataset.kind)")) == {"join"}
    pg.locator('#events-filter button[data-kind="not-round"]').click()
    expect(pg.locator("#events li[data-kind=join]")).not_to_have_count(0)
    expect(pg.locator("#events li[data-kind=round]")).to_have_count(0)
    pg.locator('#events-filter button[data-kind="all"]').click()
    expect(pg.locator("#events li[data-kind=round]").first).to_be_visible()
    assert not page.errors, page.errors
