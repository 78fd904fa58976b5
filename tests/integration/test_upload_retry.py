"""An upload retried while an earlier attempt of it is still in progress (a link gone silent
mid-body, not yet timed out): the retry takes over (the coordinator closes the older
connection) and sends its body once, where it used to write the whole update into every 429
until the older timed out (issue #34: 19.5x the update on the wire for a link silent for 2 s)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient, RetryPolicy
from fedtrain.wire import DIGEST_HEADER, EncodedBody
from tests.helpers.config import PTOKEN, tiny_config


class CountedBody(EncodedBody):
    """An update that counts how many times its bytes were sent."""

    sent = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        type(self).sent += 1
        return super().__iter__()


def stalled_upload(c: BackgroundCoordinator, key: str, body: EncodedBody) -> socket.socket:
    """A PUT of `body` from p0 for round 0 whose connection sends half the body and goes silent."""
    data = b"".join(bytes(chunk) for chunk in body)
    head = (f"PUT /v1/rounds/0/updates/p0?tokens=100 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {PTOKEN}\r\n"
            f"X-Fedtrain-Participant-Key: {key}\r\n{DIGEST_HEADER}: {body.digest()}\r\n"
            f"Content-Length: {len(data)}\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
    sock = socket.create_connection((c.host, c.port))
    sock.sendall(head + data[: len(data) // 2])
    return sock


def test_a_retry_sends_no_body_while_an_earlier_attempt_holds_the_upload(tmp_path: Path) -> None:
    with BackgroundCoordinator(tmp_path / "state", tiny_config()) as c, \
            CoordinatorClient(c.url, PTOKEN, retry=RetryPolicy(max_elapsed_s=60)) as client:
        client.join("p0")
        key = client.participant_key("p0")
        assert key is not None
        update = {n: torch.full_like(t, 0.01) for n, t in c.service.inspect().weights.items()}
        silent = stalled_upload(c, key, EncodedBody(update))
        deadline = time.monotonic() + 10
        while not client.wait_round(0, "p0", wait_s=0).get("upload_in_progress"):
            assert time.monotonic() < deadline, "the stalled upload never took its slot"
            time.sleep(0.05)
        # the dead link would go away after ~30 s (here: closed; in the field: the body timeout)
        timer = threading.Timer(30.0, silent.close)
        timer.daemon = True
        timer.start()
        body = CountedBody(update)
        body.digest()  # hashed once, by iterating its bytes: not a send
        CountedBody.sent = 0
        answer = client.upload(0, "p0", body, tokens=100)
        assert answer["accepted"] is True
        # the retry took over from the silent attempt at once: its body went once
        assert CountedBody.sent == 1, CountedBody.sent
        # counted once, whole (the round may have closed on it already)
        assert [(s["participant_id"], s["tokens"]) for s in c.service.submissions(0)] == [("p0", 100)]
        timer.cancel()
        silent.close()
