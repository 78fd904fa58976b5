"""A coordinator that stops answers its long polls and ends its event streams first: a stop
never waits for a participant's `wait`, and nobody's request is cut off without an answer."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.api import client
from tests.helpers.config import tiny_config


def test_a_stop_answers_the_long_polls_and_ends_the_streams(tmp_path: Path) -> None:
    # graceful_shutdown_s=30: without the early answer, the stop would wait out the 60 s poll
    # for 30 s and then cancel it, and the poll would get no answer at all
    c = BackgroundCoordinator(tmp_path / "state", tiny_config(), graceful_shutdown_s=30).start()
    answers: dict[str, Any] = {}
    try:
        with client(c) as http:
            assert http.post("/v1/join", json={"name": "a"}).status_code == 200
            opened = threading.Event()

            def poll() -> None:
                with client(c) as h:
                    opened.set()
                    answers["poll"] = h.get("/v1/rounds/0", params={"wait": 60}, timeout=90)

            def stream() -> None:
                with client(c) as h, h.stream("GET", "/v1/stream", timeout=90) as r:
                    answers["stream_status"] = r.status_code
                    answers["stream"] = "".join(r.iter_text())  # returns once the stream ends

            threads = [threading.Thread(target=f) for f in (poll, stream)]
            for t in threads:
                t.start()
            opened.wait(10)
            wait_for_subscriber(c)
    finally:
        stopper = threading.Thread(target=c.stop)
        stopper.start()
        for t in threads:
            t.join(timeout=20)
        stopper.join(timeout=40)
    assert not any(t.is_alive() for t in threads), "a long poll or a stream outlived the stop"
    poll_answer = answers["poll"]
    assert isinstance(poll_answer, httpx.Response) and poll_answer.status_code == 200, poll_answer
    assert poll_answer.json()["state"] == "open"  # the round did not close: the answer says so
    assert answers["stream_status"] == 200 and "event: hello" in answers["stream"]


def wait_for_subscriber(c: BackgroundCoordinator) -> None:
    deadline = time.monotonic() + 10
    while c.service.broadcast.count < 1:
        assert time.monotonic() < deadline, "the stream never subscribed"
        time.sleep(0.02)
    time.sleep(1.0)  # the long poll, sent before the stream, is waiting by now too
