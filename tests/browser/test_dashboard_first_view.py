"""The dashboard's first seconds and its cards, on a custom model's run with no participant yet:
while the event stream connects the participants panel says so (not "No participant has joined
yet.", which is news only once a status came), the outer optimizer shows the lr in force (the
number the coordinator resolved, where the config leaves it unset), and the config panel shows
the custom model as the coordinator knows it, not the GPT defaults of the `model` section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Route, expect

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.merge.outer_lr import recommended_outer_lr
from tests.helpers.browser import Page
from tests.helpers.config import ATOKEN, tiny_config
from tests.helpers.runs import initial_model
from tests.helpers.tiny import init_file

# xdist: one Chromium at a time on two cores (its waits are bounded)
pytestmark = pytest.mark.xdist_group("browser")


def test_connecting_then_empty_and_the_outer_lr_in_force(page: Page, tmp_path: Path) -> None:
    cfg = tiny_config(rounds=1, min_participants=2)  # outer.lr unset: DiLoCo's recommended lr for M=2, H=5
    assert cfg.outer.algorithm == "diloco" and cfg.outer.lr is None
    lr = recommended_outer_lr(2, cfg.train.sync_every)
    held: list[Any] = []

    def hold(route: Route) -> None:
        held.append(route)

    with BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, initial_model())) as c:
        assert c.service.status()["outer_lr"] == pytest.approx(lr)
        pg = page.page
        pg.route("**/v1/stream*", hold)  # the event stream does not answer yet
        pg.goto(f"{c.url}/#token={ATOKEN}")
        expect(pg.locator("#conn")).to_have_attribute("data-state", "connecting")
        expect(pg.locator("#parts-empty")).to_be_visible()
        expect(pg.locator("#parts-empty")).to_contain_text("Connecting")
        expect(pg.locator("#parts-empty")).not_to_contain_text("No participant")
        assert held  # the page asked for the stream: it is waiting on it, as on a slow network
        for route in held:
            route.continue_()
        pg.unroute("**/v1/stream*")
        expect(pg.locator("body")).to_have_attribute("data-ready", "1")
        expect(pg.locator("#parts-empty")).to_have_text("No participant has joined yet.")
        shown = f"{lr:.4g}"
        expect(pg.locator("#c-alg-sub")).to_contain_text(f"lr {shown}")
        expect(pg.locator("#f-outer-lr")).to_have_attribute("placeholder", f"{shown} (default)")
        # a custom model's run (--init-weights): the config panel shows that model, not GPT defaults
        expect(pg.locator("#config-json")).to_contain_text('"custom": true')
        expect(pg.locator("#config-json")).to_contain_text('"init_weights": "init.safetensors"')
        expect(pg.locator("#config-json")).not_to_contain_text("n_layer")
        pg.goto("about:blank")  # the page's event stream ends before the coordinator stops
    assert not page.errors, page.errors
