"""The participant client retries 429 (too many requests) and honours Retry-After, bounded
by its RetryPolicy; a join refused `name_in_use` is waited for, then raised as it is.

A scripted stand-in for the coordinator on loopback answers each request with the next
canned answer, so that what the client is told is the test's. Waits are read from the
client's own retry log lines ("retrying in 0.2s"), never timed."""

from __future__ import annotations

import email.utils
import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fedtrain.errors import CoordinatorError, CoordinatorUnavailable
from fedtrain.participant import CoordinatorClient, RetryPolicy

Answer = tuple[int, dict, dict[str, str]]  # status, JSON body, headers

FAST = RetryPolicy(initial_s=0.05, max_backoff_s=0.3, max_elapsed_s=5.0)


def refusal(status: int, code: str, details: dict | None = None, **headers: str) -> Answer:
    body = {"error": {"status": status, "code": code, "message": f"{code} (test)", "details": details or {}}}
    return status, body, {k.replace("_", "-"): v for k, v in headers.items()}


@contextmanager
def scripted(answers: list[Answer]) -> Iterator[tuple[str, list[str]]]:
    """A server that gives `answers` in turn (the last one for ever after); yields its URL
    and the request lines it saw, with the participant key header when one came."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            self.rfile.read(length)
            key = self.headers.get("x-fedtrain-participant-key")
            seen.append(f"{self.command} {self.path}" + (f" key={key}" if key else ""))
            status, body, headers = answers[min(len(seen), len(answers)) - 1]
            data = json.dumps(body).encode()
            self.send_response(status)
            for k, v in {"content-type": "application/json", **headers}.items():
                self.send_header(k, v)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def waits(caplog: pytest.LogCaptureFixture) -> list[float]:
    return [float(r.getMessage().rsplit("retrying in ", 1)[1].rstrip("s"))
            for r in caplog.records if "retrying in" in r.getMessage()]


def test_429_is_retried_after_what_retry_after_says_within_the_policy(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "fedtrain.participant")
    in_an_hour = email.utils.formatdate(time.time() + 3600, usegmt=True)
    answers = [
        refusal(429, "upload_in_progress", Retry_After="0.2"),
        refusal(429, "upload_in_progress", Retry_After="3600"),  # bounded by max_backoff_s
        refusal(429, "upload_in_progress", Retry_After=in_an_hour),  # an HTTP date, bounded too
        refusal(429, "upload_in_progress", {"retry_after_s": 0.1}),  # the JSON details, without the header
        (200, {"run": "x", "current_round": 0}, {}),
    ]
    with scripted(answers) as (url, seen), CoordinatorClient(url, "t", retry=FAST) as client:
        assert client.status()["run"] == "x"
    assert len(seen) == 5
    assert waits(caplog) == [0.2, 0.3, 0.3, 0.1]


def test_429_without_retry_after_backs_off_and_gives_up_within_the_budget(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "fedtrain.participant")
    policy = RetryPolicy(initial_s=0.05, max_backoff_s=0.1, max_elapsed_s=0.5)
    with scripted([refusal(429, "too_many")]) as (url, seen), CoordinatorClient(url, "t", retry=policy) as client:
        with pytest.raises(CoordinatorUnavailable):
            client.status()
    assert len(seen) >= 3 and len(waits(caplog)) == len(seen) - 1  # retried, then given up (max_elapsed_s)
    assert all(w <= 0.1 for w in waits(caplog))  # each wait within max_backoff_s


def test_a_join_whose_name_is_in_use_waits_for_it_then_carries_the_key(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "fedtrain.participant")
    joined = {"participant_id": "site", "participant_key": "fk_test-key"}
    answers = [refusal(409, "name_in_use", {"retry_after_s": 0.2}, Retry_After="1"), (200, joined, {}),
               (200, {"current_round": 0, "state": "active"}, {})]
    with scripted(answers) as (url, seen), CoordinatorClient(url, "t", retry=FAST) as client:
        assert client.join("site")["participant_key"] == "fk_test-key"
        client.heartbeat("site", step=1)
        client.clone().heartbeat("site", step=2)  # a clone speaks for the same participants
    assert waits(caplog) == [0.2]  # the JSON's retry_after_s (finer than the header's whole seconds)
    assert seen[:2] == ["POST /v1/join", "POST /v1/join"]
    assert seen[2:] == ["POST /v1/participants/site/heartbeat key=fk_test-key"] * 2


def test_a_name_still_in_use_when_the_wait_is_spent_is_raised_as_it_is() -> None:
    policy = RetryPolicy(initial_s=0.05, max_backoff_s=0.1, max_elapsed_s=0.3)
    with scripted([refusal(409, "name_in_use", {"retry_after_s": 30})]) as (url, seen), \
            CoordinatorClient(url, "t", retry=policy) as client:
        with pytest.raises(CoordinatorError) as info:
            client.join("site")
    assert (info.value.status, info.value.code) == (409, "name_in_use") and len(seen) >= 2
    with scripted([refusal(409, "name_taken")]) as (url, seen), CoordinatorClient(url, "t", retry=policy) as client:
        with pytest.raises(CoordinatorError) as info:
            client.join("site")
    assert info.value.code == "name_taken" and len(seen) == 1  # any other 409 is not retried
