"""The dashboard in headless Chromium against a live run: the page fills from the API and
the SSE stream, a config change made in the form reaches every participant at one round
boundary, an invalid change shows its error and changes nothing, participant tokens get a
read-only view, an admin can evict or roll the run back to a kept version, the event log
filters by kind, and an FSDP group shows its ranks and its update's pieces as they come in."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch
from playwright.sync_api import Dialog, Route, expect

from fedtrain.coordinator.members.auth import KEY_HEADER
from tests.helpers.api import halves, send_piece
from tests.helpers.browser import ARTIFACTS, SITES, LiveRun, Page
from tests.helpers.config import ATOKEN, PTOKEN

# xdist: one Chromium at a time on two cores (its waits are bounded), one live run per module
pytestmark = pytest.mark.xdist_group("browser")


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
    # a 1400 px window shows the participants table whole, up to its Admin column (no hidden scroll)
    pg.set_viewport_size({"width": 1400, "height": 900})
    fits = pg.evaluate("""() => { const wrap = document.querySelector('#participants').parentElement;
        const evict = document.querySelector('#participants tbody button[data-evict]').getBoundingClientRect();
        return {scroll: wrap.scrollWidth, width: wrap.clientWidth,
                evictRight: evict.right, wrapRight: wrap.getBoundingClientRect().right}; }""")
    assert fits["scroll"] <= fits["width"] and fits["evictRight"] <= fits["wrapRight"], fits
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
    assert [v["version"] for v in live_run.coordinator.service.config_history()] == [1]
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
    [latest, *_] = live_run.coordinator.service.config_history()
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
    expect(pg.locator("#rollback")).to_be_hidden()
    expect(pg.locator("#rollback-version option")).to_have_count(0)  # the kept versions are never asked for
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
    assert live_run.coordinator.service.inspect().participants["ghost"].state == "evicted"
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


def admin_get(run: LiveRun, path: str) -> dict[str, Any]:
    return httpx.get(f"{run.url}{path}", headers={"Authorization": f"Bearer {ATOKEN}"}).json()


def rollbacks(run: LiveRun) -> list[str]:
    return [e["message"] for e in admin_get(run, "/v1/events?limit=1000")["events"] if e["kind"] == "rollback"]


def refuse_round_closing(route: Route) -> None:
    """The coordinator's refusal when a round is closing, in its one error shape."""
    error = {"status": 409, "code": "round_closing", "message": "round 99 is closing; try again in a moment"}
    route.fulfill(status=409, content_type="application/json", body=json.dumps({"error": {**error, "details": {}}}))


def test_admin_rolls_back_to_a_kept_version_from_the_dashboard(page: Page, live_run: LiveRun) -> None:
    pg = page.page
    pg.goto(f"{live_run.url}/#token={ATOKEN}")  # not open_dashboard: an earlier test may have added a participant
    expect(pg.locator("body")).to_have_attribute("data-ready", "1")
    select, go, result = pg.locator("#rollback-version"), pg.locator("#rollback-go"), pg.locator("#rollback-result")
    expect(select).to_be_visible()
    expect(go).to_be_disabled()  # nothing chosen yet
    newest = select.locator("option").nth(1)
    expect(newest).to_have_text(re.compile(r"^v\d+ \(in force\)$"))
    # The newest kept version: still kept when the POST lands, even if rounds commit meanwhile.
    version = newest.get_attribute("value")
    assert version is not None

    select.select_option(version)
    pg.once("dialog", lambda d: d.dismiss())  # a dismissed confirm changes nothing
    go.click()
    expect(go).to_be_enabled()
    expect(result).to_be_empty()
    assert rollbacks(live_run) == []

    dialogs: list[str] = []

    def accept(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    pg.on("dialog", accept)
    before = admin_get(live_run, "/v1/status")["current_round"]
    select.select_option(version)  # rebuilt as rounds went by, the select keeps a choice that is still kept
    go.click()
    expect(result).to_have_attribute("data-state", "ok")
    expect(result).to_contain_text(f"holds the weights of version {version}")
    [message] = dialogs
    asked = rf"^Roll back to version {version}\?\s+Round (\d+) closes with no updates and version (\d+) gets the "
    asked += rf"weights of version {version}\. Participants fetch it at their next sync\.$"
    said = re.match(asked, message)
    assert said and int(said[2]) == int(said[1]) + 1 and int(said[1]) >= before, message
    done = re.search(r"version (\d+) holds", result.inner_text())
    assert done, result.inner_text()
    new = int(done[1])
    assert new > before
    # the status' current round advanced past the roll back, the page follows, and says why
    assert admin_get(live_run, "/v1/status")["current_round"] >= new
    wait_for(lambda: int(pg.locator("#c-round").inner_text().split()[0]) >= new, 30, "the round card to advance")
    row = pg.locator(f'#rounds tbody tr[data-round="{new - 1}"]')
    expect(row.locator("td.reason")).to_have_text(f"rolled back to version {version} by admin")
    expect(row).to_have_class("rolled-back")
    expect(pg.locator("#events li[data-kind=rollback]").first).to_contain_text(
        f"version {new} holds the weights of version {version}"
    )
    assert len(rollbacks(live_run)) == 1
    ARTIFACTS.mkdir(exist_ok=True)
    pg.locator("#rounds-wrap").locator("xpath=..").screenshot(path=str(ARTIFACTS / "dashboard-rollback.png"))

    # a refusal is shown inline in the coordinator's words, never as an alert
    pg.route("**/v1/admin/rollback", refuse_round_closing)
    select.select_option(index=1)
    go.click()
    expect(result).to_have_attribute("data-state", "error")
    expect(result).to_have_text("Not rolled back: round 99 is closing; try again in a moment")
    assert len(dialogs) == 2  # the second confirm, and nothing else
    expect(go).to_be_enabled()
    pg.unroute("**/v1/admin/rollback")
    assert not [e for e in page.errors if "409" not in e], page.errors  # the refused POST logs one 409


def keep_alive(run: LiveRun, pid: str, key: str, done: threading.Event) -> threading.Thread:
    """Heartbeats for `pid` every half second until `done`, on a connection of their own: a
    participant silent for the run's heartbeat_timeout_s would be failed, and the round would
    close without it."""
    headers = {"Authorization": f"Bearer {ATOKEN}", KEY_HEADER: key}

    def beat() -> None:
        with httpx.Client(base_url=run.url, headers=headers, timeout=30) as http:
            while not done.wait(0.5):
                http.post(f"/v1/participants/{pid}/heartbeat", json={})

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return thread


def test_an_fsdp_group_shows_its_ranks_and_its_pieces_as_they_come_in(page: Page, live_run: LiveRun) -> None:
    pg = page.page
    pg.goto(f"{live_run.url}/#token={ATOKEN}")  # not open_dashboard: an earlier test may have added a participant
    expect(pg.locator("body")).to_have_attribute("data-ready", "1")
    for name in SITES:  # the sites are single processes
        expect(pg.locator(f'#participants tbody tr[data-pid="{name}"] td.ranks')).to_have_text("1")
    pid, c = "fsdp-group", live_run.coordinator
    zeros = {n: torch.zeros_like(t) for n, t in c.service.inspect().weights.items()}  # a no-op update: the run goes on
    (t0, rows0), (t1, rows1) = halves(zeros)
    done = threading.Event()
    # The admin token: the participant token may add no participant for a while after the eviction above.
    with httpx.Client(base_url=live_run.url, headers={"Authorization": f"Bearer {ATOKEN}"}, timeout=30) as http:
        joined = http.post("/v1/join", json={"name": pid, "info": {"parallel": "fsdp", "world_size": 2}})
        assert joined.status_code == 200, joined.text
        http.headers[KEY_HEADER] = joined.json()["participant_key"]
        beats = keep_alive(live_run, pid, joined.json()["participant_key"], done)
        try:
            row = pg.locator(f'#participants tbody tr[data-pid="{pid}"]')
            expect(row.locator("td.ranks .par.fsdp")).to_have_text("fsdp×2")
            # Active now, the group holds the open round back until its update is whole: the first piece
            # goes into the round that is open (a round that was closing at the join is the next one's).
            for _ in range(5):
                round_ = http.get("/v1/status").json()["current_round"]
                first = send_piece(http, pid, "rank0", t0, rows0, tokens=1, round_=round_)
                if first.status_code != 409:
                    break
            assert first.status_code == 200 and first.json()["complete"] is False, first.text
            coming = pg.locator(f'#rounds tr.open-round .chip.partial[data-pieces="{pid}"]')
            expect(coming).to_have_text(f"{pid} · 1/2 pieces")
            expect(coming).to_have_attribute("title", re.compile(r"^pieces in: rank0 · \d+% of the sync set$"))
            ARTIFACTS.mkdir(exist_ok=True)
            pg.locator("#participants").locator("xpath=../..").screenshot(path=str(ARTIFACTS / "dashboard-ranks.png"))
            pg.locator("#rounds-wrap").screenshot(path=str(ARTIFACTS / "dashboard-pieces.png"))
            last = send_piece(http, pid, "rank1", t1, rows1, tokens=1, round_=round_)
            assert last.status_code == 200 and last.json()["complete"] is True, last.text
            # whole: counted in the round like any update, which closes once the sites are in too
            expect(coming).to_have_count(0)
            closed = pg.locator(f'#rounds tbody tr[data-round="{round_}"]')
            expect(closed.locator(".chip", has_text=pid)).to_have_count(1)
        finally:
            done.set()
            beats.join(10)
            http.post(f"/v1/participants/{pid}/leave")  # the run's rounds no longer wait for it
    expect(row.locator("td.ranks")).to_have_text("fsdp×2")  # what it said stays on its row
    assert not page.errors, page.errors
