"""Browser fixtures: headless Chromium from Debian (/usr/bin/chromium) driven by Python
Playwright, and a live run (a coordinator with participants training in threads).

The browser tests are part of the default run; outside CI they skip, saying why, when
Chromium or Playwright is not installed; in CI (.ci/run installs both) that is a failure.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.browser import SITES, LiveRun, Page
from tests.helpers.config import tiny_config
from tests.helpers.tiny import TinyGPT, TinyParticipant, join_all

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


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


def _site(run: LiveRun, i: int, name: str) -> TinyParticipant:
    """Site i of 3: batches of 4 x 32 tokens, evals on 2 held-out batches, a pause after each step
    to leave the shared cores some room for the browser."""
    task = TinyGPT(shard=i, of=3, model_seed=i, batch_size=4, seq_len=32, eval_batches=2)
    return TinyParticipant(run.url, name, task, stop=run.stop, step_sleep_s=0.03)


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    """A run with no end (rounds=0) and three participants training until the module is done."""
    # Rounds commit about once a second here; keeping 30 versions keeps the one a test chose while
    # it clicks through a confirm, even on a loaded machine (with 3, CI once saw it pruned first).
    cfg = tiny_config(rounds=0, name="browser-test", keep_checkpoints=30)
    with BackgroundCoordinator(tmp_path_factory.mktemp("dashboard") / "state", cfg) as c:
        run = LiveRun(c)
        run.participants = {name: _site(run, i, name).start() for i, name in enumerate(SITES)}
        deadline = time.monotonic() + 60
        while c.service.version < 2 and not run.errors and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not run.errors, run.errors
        assert c.service.version >= 2, "the participants did not complete two rounds within 60 s"
        try:
            yield run
        finally:
            run.stop.set()
            join_all(*run.participants.values(), timeout=60)  # raises what a participant raised
