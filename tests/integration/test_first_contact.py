"""First contact with a wrong address: each mistake fails at once (or after a short first-contact
budget) with one sentence that says what to change, and never a page of HTML; an outage in the
middle of a run is still ridden out for the long budget.

The servers here are the real coordinator (plain or TLS) and a stdlib `http.server` that is not
a coordinator, all on 127.0.0.1 free ports, all stopped by the test.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.errors import (
    AuthError,
    CoordinatorUnavailable,
    NotACoordinatorError,
    TLSError,
)
from fedtrain.participant import CoordinatorClient, Participant, RetryPolicy
from fedtrain.participant.engine.outage import is_transient
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.processes import free_port
from tests.helpers.tiny import Small
from tests.helpers.tls import make_tls

# A long budget (a run's outage) and a short one for first contact: a client that used the long
# one at first contact would retry 8 s and say so in its message.
LONG = RetryPolicy(initial_s=0.05, max_backoff_s=0.2, max_elapsed_s=8.0, first_contact_s=1.0)
# For errors that must not be retried at all: a wrong implementation retries for 2 s and then
# raises CoordinatorUnavailable, which the test sees at once as the wrong exception.
SHORT = RetryPolicy(initial_s=0.05, max_backoff_s=0.2, max_elapsed_s=2.0, first_contact_s=2.0)

PAGE = b"<!DOCTYPE html><html><head><title>404 Not Found</title></head><body><h1>Not Found</h1>" + b"." * 400


def retries(caplog: pytest.LogCaptureFixture) -> int:
    """How many times the client said it would try again."""
    return sum("retrying in" in r.getMessage() for r in caplog.records if r.name == "fedtrain.participant")


class _Page(BaseHTTPRequestHandler):
    """A web server that is not a coordinator: `status` and `body` for every request."""

    status = 404
    body, content_type = PAGE, "text/html; charset=utf-8"

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self.send_response(self.status)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve_page(status: int, body: bytes = PAGE, content_type: str = "text/html") -> Iterator[str]:
    """A plain HTTP server on a free loopback port answering `status` and `body` to everything."""
    handler = type("Page", (_Page,), {"status": status, "body": body, "content_type": content_type})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def web_page() -> Iterator[str]:
    """The URL of a plain HTTP server that answers HTML 404 to everything."""
    with serve_page(404) as url:
        yield url


@pytest.fixture
def tls_coordinator(tmp_path: Path) -> Iterator[tuple[BackgroundCoordinator, Path]]:
    ca, cert, key = make_tls(tmp_path / "tls")
    with BackgroundCoordinator(tmp_path / "tls-state", tiny_config(), tls_cert=cert, tls_key=key) as c:
        yield c, ca


# -- a refused connection ------------------------------------------------------------------------


def test_a_closed_port_at_first_contact_fails_after_the_first_contact_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    caplog.set_level(logging.WARNING, "fedtrain.participant")
    with CoordinatorClient(f"http://127.0.0.1:{port}", PTOKEN, retry=LONG) as client:
        with pytest.raises(CoordinatorUnavailable) as info:
            client.status()
        assert not client.reached
    message = info.value.message
    assert f"connection refused at 127.0.0.1:{port}" in message, message
    assert "is the coordinator running, and is that its port?" in message
    assert "did not answer" not in message and "retried for 1s" in message
    assert 1 <= retries(caplog) < 20  # backoff from 0.05 s over 1 s: a handful, not 8 s of them (~45)


def test_a_participant_pointed_at_a_closed_port_stops_at_join() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(CoordinatorUnavailable) as info:
        with Participant(url, token=PTOKEN, model=Small(), name="p", retry=LONG):
            pass
    assert "POST /v1/join: connection refused at" in info.value.message, info.value.message
    assert "retried for 1s" in info.value.message


def test_the_first_contact_budget_is_short_and_bounded_by_the_long_one() -> None:
    default = RetryPolicy()
    assert default.budget_s(first_contact=True) <= 20 < default.budget_s(first_contact=False) == 300
    assert RetryPolicy(max_elapsed_s=5).budget_s(first_contact=True) == 5  # `fedtrain status` keeps its 5 s
    assert RetryPolicy(first_contact_s=0).next_delay(0, 0.0, first_contact=True) is None
    assert RetryPolicy(first_contact_s=0).next_delay(0, 0.0, first_contact=False) is not None
    with pytest.raises(ValueError):
        RetryPolicy(first_contact_s=-1)


def test_a_refused_connection_mid_run_keeps_the_long_budget(tmp_path: Path) -> None:
    policy = RetryPolicy(initial_s=0.05, max_backoff_s=0.2, max_elapsed_s=1.5, first_contact_s=0.0)
    c = BackgroundCoordinator(tmp_path / "state", tiny_config()).start()
    try:
        client = CoordinatorClient(c.url, PTOKEN, retry=policy)
        assert not client.reached
        assert client.health()["ok"] and client.reached
        heart = client.clone()
        assert heart.reached  # a clone talks to the same coordinator
    finally:
        c.stop()
    with client, heart:
        for who in (client, heart):
            with pytest.raises(CoordinatorUnavailable) as info:
                who.status()  # with first contact's budget of 0 s this would fail without one retry
            message = info.value.message
            assert f"connection refused at 127.0.0.1:{c.port} for 1.5s" in message, message
            assert "answered before" in message and "did not answer" not in message


# -- TLS that does not match -------------------------------------------------------------------


def test_https_against_a_plain_http_coordinator_says_use_http(
    coordinator: BackgroundCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "fedtrain.participant")
    url = coordinator.url.replace("http://", "https://")
    with CoordinatorClient(url, PTOKEN, retry=SHORT, verify=False) as client:
        with pytest.raises(TLSError) as info:
            client.status()
    message = info.value.message
    assert info.value.code == "tls_error"
    assert f"{url} does not speak TLS: use http://127.0.0.1:{coordinator.port}" in message, message
    assert "WRONG_VERSION_NUMBER" not in message
    assert retries(caplog) == 0
    assert not is_transient(info.value)


def test_http_against_a_tls_coordinator_says_use_https(
    tls_coordinator: tuple[BackgroundCoordinator, Path], caplog: pytest.LogCaptureFixture
) -> None:
    c, _ = tls_coordinator
    caplog.set_level(logging.WARNING, "fedtrain.participant")
    url = c.url.replace("https://", "http://")
    with CoordinatorClient(url, PTOKEN, retry=SHORT) as client:
        with pytest.raises(TLSError) as info:
            client.health()
    message = info.value.message
    assert f"{url} speaks TLS: use https://127.0.0.1:{c.port}" in message, message
    assert "Server disconnected" not in message
    assert retries(caplog) == 0


def test_an_untrusted_certificate_fails_at_once_and_names_the_flag(
    tls_coordinator: tuple[BackgroundCoordinator, Path], caplog: pytest.LogCaptureFixture
) -> None:
    c, ca = tls_coordinator
    caplog.set_level(logging.WARNING, "fedtrain.participant")
    with CoordinatorClient(c.url, PTOKEN, retry=SHORT) as client:
        with pytest.raises(TLSError) as info:
            client.status()
    assert "cannot be verified" in info.value.message and "--ca-cert" in info.value.message
    assert retries(caplog) == 0
    with CoordinatorClient(c.url, PTOKEN, verify=str(ca)) as trusted:
        assert trusted.health()["ok"]


# -- not a coordinator -------------------------------------------------------------------------


def test_a_web_server_that_is_not_a_coordinator_is_named_without_its_page(
    web_page: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "fedtrain.participant")
    with CoordinatorClient(web_page, PTOKEN, retry=SHORT) as client:
        for call, where in ((client.status, "GET /v1/status"), (client.health, "GET /v1/healthz")):
            with pytest.raises(NotACoordinatorError) as info:
                call()
            message = info.value.message
            assert message == (
                f"{web_page} does not look like a fedtrain coordinator (HTTP 404 from {where}): "
                "check the address and port"
            )
            assert info.value.status == 404 and not is_transient(info.value)
    with pytest.raises(NotACoordinatorError) as info:
        with Participant(web_page, token=PTOKEN, model=Small(), name="p", retry=SHORT):
            pass
    assert "HTTP 404 from POST /v1/join" in info.value.message and "<" not in info.value.message
    assert retries(caplog) == 0


@pytest.mark.parametrize(("status", "why"), [(200, "its answer to GET /v1/status is not JSON but text/html"),
                                             (500, "HTTP 500 from GET /v1/status")])
def test_a_web_server_answering_html_is_not_a_coordinator(status: int, why: str) -> None:
    with serve_page(status) as url:
        with CoordinatorClient(url, PTOKEN, retry=SHORT) as client:
            with pytest.raises(NotACoordinatorError) as info:
                client.status()
    assert why in info.value.message and "<" not in info.value.message
    assert not is_transient(info.value)  # mid-run too: a participant stops instead of training on alone


def test_a_proxy_s_own_413_names_its_body_limit() -> None:
    """A reverse proxy's HTML 413 (nginx at its default client_max_body_size) is not the
    coordinator's refusal: the message says where to raise the limit (docs/deploy.md)."""
    with serve_page(413, b"<html><body>413 Request Entity Too Large</body></html>") as url:
        with CoordinatorClient(url, PTOKEN, retry=SHORT) as client:
            with pytest.raises(NotACoordinatorError) as info:
                client.status()
    assert info.value.code == "proxy_body_limit" and "client_max_body_size" in info.value.message
    assert "does not look like" not in info.value.message and "<" not in info.value.message


def test_another_json_api_is_not_a_coordinator() -> None:
    with serve_page(200, b'{"hello": "world"}', "application/json") as url:
        with CoordinatorClient(url, PTOKEN, retry=SHORT) as client:
            for call, where, key in ((lambda: client.join("p"), "POST /v1/join", "participant_id"),
                                     (client.health, "GET /v1/healthz", "ok")):
                with pytest.raises(NotACoordinatorError) as info:
                    call()
                assert f"(its answer to {where} has no {key!r})" in info.value.message, info.value.message


def test_a_proxy_page_for_a_coordinator_that_restarts_is_retried_and_never_shown() -> None:
    with serve_page(502) as url:
        with CoordinatorClient(url, PTOKEN, retry=RetryPolicy(initial_s=0.05, max_elapsed_s=0.3)) as client:
            with pytest.raises(CoordinatorUnavailable) as info:
                client.status()
    assert "HTTP 502 Bad Gateway from GET /v1/status" in info.value.message, info.value.message
    assert "<" not in info.value.message


def test_a_coordinator_under_another_path_is_not_one_at_this_address(coordinator: BackgroundCoordinator) -> None:
    with CoordinatorClient(coordinator.url + "/fedtrain", PTOKEN, retry=SHORT) as client:
        with pytest.raises(NotACoordinatorError) as info:
            client.join("p")
    assert "(HTTP 404 from POST /v1/join)" in info.value.message


def test_a_url_without_a_scheme_is_refused_before_any_request() -> None:
    with pytest.raises(NotACoordinatorError) as info:
        CoordinatorClient("127.0.0.1:8000", PTOKEN)
    assert "give http://HOST:PORT" in info.value.message


# -- a refused token ---------------------------------------------------------------------------


def test_a_wrong_token_is_refused_at_once(coordinator: BackgroundCoordinator, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "fedtrain.participant")
    with pytest.raises(AuthError) as info:
        with Participant(coordinator.url, token="not-the-token", model=Small(), name="p", retry=SHORT):
            pass
    message = info.value.message
    assert info.value.status == 401
    assert message.startswith(f"the coordinator at {coordinator.url} refused the token: invalid token"), message
    assert "--token" in message
    assert retries(caplog) == 0


# -- the command line ----------------------------------------------------------------------------


def _status(url: str, *extra: str) -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        "from fedtrain.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "assert 'torch' not in sys.modules, 'fedtrain status imported torch'\n"
        "sys.exit(rc)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "status", "--coordinator", url, "--token", "x", *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_fedtrain_status_prints_one_line_for_each_wrong_address(
    web_page: str, coordinator: BackgroundCoordinator
) -> None:
    cases = {
        web_page: "does not look like a fedtrain coordinator (HTTP 404 from GET /v1/status)",
        coordinator.url.replace("http://", "https://"): "does not speak TLS: use http://",
        coordinator.url: "refused the token: invalid token",
    }
    for url, expected in cases.items():
        r = _status(url, "--insecure")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, r.stderr
        assert len(lines) == 1 and lines[0].startswith("fedtrain status: error: "), r.stderr
        assert expected in lines[0] and "Traceback" not in r.stderr and "<" not in r.stderr


def test_fedtrain_status_at_a_closed_port_says_refused(tmp_path: Path) -> None:
    port = free_port()
    r = _status(f"http://127.0.0.1:{port}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("fedtrain status: error: ") and f"connection refused at 127.0.0.1:{port}:" in last, last


def test_the_client_module_does_not_import_torch() -> None:
    code = ("import sys, fedtrain.participant.client.coordinator_client, fedtrain.participant.engine.outage; "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_the_download_still_loads_the_model_after_the_lazy_imports(coordinator: BackgroundCoordinator) -> None:
    with CoordinatorClient(coordinator.url, PTOKEN) as client:
        version, tensors = client.download()
    assert version == 0 and tensors and all(isinstance(t, torch.Tensor) for t in tensors.values())
