"""Browser fixtures: headless Chromium from Debian (/usr/bin/chromium) driven by Python
Playwright, and a live run (a coordinator with participants training in threads).

The browser tests are part of the default run; outside CI they skip, saying why, when
Chromium or Playwright is not installed; in CI (.ci/run installs both) that is a failure.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient, Participant
from fedtrain.recipes import build_model
from fedtrain.recipes.data import TokenStream, evaluate, load_tokens, parse_data_spec
from tests.conftest import PTOKEN, tiny_config

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
SITES = ("site-a", "site-b", "site-c")


# Module scope, not session: while Playwright's sync API is open, an asyncio loop runs on this thread
# and any later test calling asyncio.run() would fail.
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    # In CI (.ci/run installs both) a missing browser is a failure, never a silent skip.
    missing = pytest.fail if os.environ.get("CI") else pytest.skip
    if not CHROMIUM.exists():
        missing(f"browser tests need {CHROMIUM}: apt-get install -y chromium chromium-driver")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("browser tests need Python Playwright: pip install playwright (never `playwright install`)")
    from playwright.sync_api import expect

    expect.set_options(timeout=20_000)  # two shared cores: give the page time, still fail in bounded time
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@dataclass
class Page:
    """A fresh browser context (its own localStorage) and the script errors it raised."""

    page: Any
    errors: list[str] = field(default_factory=list)


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    context.set_default_timeout(30_000)
    p = Page(context.new_page())
    p.page.on("pageerror", lambda e: p.errors.append(str(e)))
    p.page.on("console", lambda m: p.errors.append(m.text) if m.type == "error" else None)
    try:
        yield p
    finally:
        context.close()


@dataclass
class LiveRun:
    coordinator: BackgroundCoordinator
    feds: dict[str, Participant] = field(default_factory=dict)
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return self.coordinator.url


def _train(run: LiveRun, i: int, name: str) -> None:
    try:
        cfg = tiny_config()
        model = build_model(cfg.model, seed=i)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
        stream = TokenStream(load_tokens(parse_data_spec(f"stdlib:{i}/3")), batch_size=4, seq_len=32, seed=i)
        held_out = list(stream.eval_batches(2))
        client = CoordinatorClient(run.url, PTOKEN)
        with Participant(client, model=model, inner_optimizer=opt, name=name,
                         eval_fn=lambda m: evaluate(m, held_out)) as fed:
            run.feds[name], run.optimizers[name] = fed, opt
            while not fed.finished and not run.stop.is_set():
                x, y = stream.next_batch()
                _, loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                fed.step(tokens=x.numel(), loss=loss.item())
                time.sleep(0.03)  # leave the shared cores some room for the browser
    except BaseException as e:
        run.errors.append(e)


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    """A run with no end (rounds=0) and three participants training until the module is done."""
    cfg = tiny_config(rounds=0, name="browser-test")
    with BackgroundCoordinator(tmp_path_factory.mktemp("dashboard") / "state", cfg) as c:
        run = LiveRun(c)
        threads = [threading.Thread(target=_train, args=(run, i, name), daemon=True) for i, name in enumerate(SITES)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while c.service.version < 2 and not run.errors and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not run.errors, run.errors
        assert c.service.version >= 2, "the participants did not complete two rounds within 60 s"
        try:
            yield run
        finally:
            run.stop.set()
            for t in threads:
                t.join(timeout=60)
    assert not run.errors, run.errors
