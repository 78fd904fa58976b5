"""Uploads in resumable parts over a faulty link (issue #34): a connection cut, silenced or
damaged mid-upload; the upload resumes and sends only what was missing (counted on the
link), and the merged model is bit-identical to the one an uninterrupted whole upload makes.
A silent older connection does not hold up its own retry: the newer attempt takes over."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import pytest
import torch

from fedtrain.config import TransferConfig
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.intake.pieces import ROWS_META
from fedtrain.participant import CoordinatorClient, RetryPolicy
from fedtrain.wire import DIGEST_HEADER, EncodedBody
from tests.helpers.api import halves
from tests.helpers.config import BOTH_TRANSPORTS, PTOKEN, tiny_config
from tests.helpers.faulty_link import FaultyLink
from tests.helpers.part_uploads import PART, delta_of, merged, parts_config, reference

pytestmark = BOTH_TRANSPORTS

TRANSFER = TransferConfig(part_mb=1, stall_timeout_s=1.0)
#: What the link carries besides the body's bytes: a request head and an answer per request.
OVERHEAD = 64 << 10


def upload_over(link: FaultyLink, c: BackgroundCoordinator, tmp_path: Path) -> tuple[dict, int, dict]:
    with CoordinatorClient(link.url, PTOKEN, retry=RetryPolicy(initial_s=0.05, max_elapsed_s=30)) as client:
        client.join("p0")
        body = EncodedBody(delta_of(c))
        start = link.bytes_up
        answer = client.upload(0, "p0", body, tokens=100, transfer=TRANSFER)
        sent = link.bytes_up - start
        return answer, sent - body.content_length, merged(c, client)


def no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]


@pytest.mark.parametrize("fault", ["cut", "stall", "corrupt"])
def test_an_upload_in_parts_resumes_sends_only_what_was_missing_and_merges_bit_for_bit(
        tmp_path: Path, fault: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    want = reference(tmp_path)
    with BackgroundCoordinator(tmp_path / "state", parts_config()) as c, FaultyLink(c.host, c.port) as link:
        at = int(2.5 * PART)  # inside the third part, the join's bytes aside
        {"cut": link.cut_after, "stall": link.stall_after, "corrupt": link.corrupt_at}[fault](at + 4096)
        answer, extra, got = upload_over(link, c, tmp_path)
        assert link.faults_hit, "the fault never fired"
        assert answer["accepted"] is True and answer["parts_complete"] is True
        # what crossed the link twice: at most the part the fault hit (and the requests' heads)
        assert extra <= PART + OVERHEAD, extra
        assert [(s["participant_id"], s["tokens"]) for s in c.service.submissions(0)] == [("p0", 100)]
    assert want.keys() == got.keys()
    for n in want:
        assert torch.equal(want[n], got[n]), n
    no_traceback(caplog)


def test_parts_go_over_several_connections_at_once_and_merge_bit_for_bit(tmp_path: Path) -> None:
    want = reference(tmp_path)
    with BackgroundCoordinator(tmp_path / "state", parts_config()) as c, FaultyLink(c.host, c.port) as link, \
            CoordinatorClient(link.url, PTOKEN) as client:
        client.join("p0")
        body = EncodedBody(delta_of(c))
        before, sent = link.connections, link.bytes_up
        link.cut_after(int(1.5 * PART))
        answer = client.upload(0, "p0", body, tokens=100,
                               transfer=TransferConfig(part_mb=1, streams=3, stall_timeout_s=1.0))
        assert answer["accepted"] is True and link.faults_hit
        assert link.connections - before >= 3  # the parts went side by side
        # the parts in flight beside the one cut went on: only that one was sent again
        assert link.bytes_up - sent - body.content_length <= PART + OVERHEAD
        got = merged(c, client)
    for n in want:
        assert torch.equal(want[n], got[n]), n


def raw_put(c: BackgroundCoordinator, key: str, data: bytes, digest: str, send: int) -> socket.socket:
    """A PUT of the whole `data` from p0 for round 0 that sends `send` bytes of it and goes silent."""
    head = (f"PUT /v1/rounds/0/updates/p0?tokens=100 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {PTOKEN}\r\n"
            f"X-Fedtrain-Participant-Key: {key}\r\n{DIGEST_HEADER}: {digest}\r\n"
            f"Content-Length: {len(data)}\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
    sock = socket.create_connection((c.host, c.port))
    sock.sendall(head + data[:send])
    return sock


def test_a_silent_older_connection_is_closed_by_the_retry_that_takes_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with BackgroundCoordinator(tmp_path / "state", tiny_config()) as c, CoordinatorClient(c.url, PTOKEN) as client:
        client.join("p0")
        key = client.participant_key("p0")
        assert key is not None
        update = {n: torch.full_like(t, 0.01) for n, t in c.service.inspect().weights.items()}
        body = EncodedBody(update)
        data = b"".join(bytes(chunk) for chunk in body)
        silent = raw_put(c, key, data, body.digest(), len(data) // 2)
        deadline = time.monotonic() + 10
        while not client.wait_round(0, "p0", wait_s=0).get("upload_in_progress"):
            assert time.monotonic() < deadline, "the silent upload never began"
            time.sleep(0.02)
        # the upload in flight shows in the status, with its progress (`Progress.view`)
        def upload_view() -> dict:
            return next(p for p in client.status()["participants"] if p["id"] == "p0")["transfer"]

        while (seen := upload_view())["bytes"] == 0:  # (counted as reads end: a batch at a time)
            assert time.monotonic() < deadline, f"the status never showed the bytes sent: {seen}"
            time.sleep(0.02)
        assert seen["total"] == len(data) and 0 < seen["bytes"] <= len(data) // 2
        assert (seen["what"], seen["direction"]) == ("upload of round 0", "up")
        row = next(p for p in client.status()["participants"] if p["id"] == "p0")
        assert [t["direction"] for t in row["transfers"]] == ["up"]  # with the downloads in flight, if any
        # the retry goes at once: no 429 for the slot the silent connection holds
        answer = client.upload(0, "p0", body, tokens=100, retry=RetryPolicy(max_elapsed_s=0))
        assert answer["accepted"] is True and answer["duplicate"] is False
        silent.settimeout(10)
        try:  # the coordinator closed the older connection (a reset, or the 409 taken_over and a close)
            while silent.recv(65536):
                pass
        except ConnectionResetError:
            pass
        silent.close()
        assert [(s["participant_id"], s["tokens"]) for s in c.service.submissions(0)] == [("p0", 100)]
    no_traceback(caplog)


def test_the_pieces_of_an_update_travel_in_parts_and_merge_as_the_update_sent_whole(tmp_path: Path) -> None:
    """An FSDP rank's piece larger than a part goes in parts too (parts are transport, pieces meaning)."""
    want = reference(tmp_path)
    with BackgroundCoordinator(tmp_path / "state", parts_config()) as c, FaultyLink(c.host, c.port) as link, \
            CoordinatorClient(link.url, PTOKEN, retry=RetryPolicy(initial_s=0.05, max_elapsed_s=30)) as client:
        client.join("p0")
        pieces = [EncodedBody(t, {ROWS_META: json.dumps(rows)}) for t, rows in halves(delta_of(c))]
        assert all(p.content_length > 2 * PART for p in pieces)
        link.cut_after(int(3.5 * PART))  # inside the second piece's parts
        answers = [client.upload(0, "p0", body, tokens=100, piece=f"rank{i}", transfer=TRANSFER)
                   for i, body in enumerate(pieces)]
        assert link.faults_hit
        assert [(a["parts_complete"], a["complete"]) for a in answers] == [(True, False), (True, True)]
        got = merged(c, client)
    for n in want:
        assert torch.equal(want[n], got[n]), n
