"""The intake reads an upload in parts as its parts arrive (`intake/parts.py` `held_body`,
`Uploads.receive_part`): the upload flow has the body's header, and has chosen where the
body goes, before the last part is sent; the update still counts only once complete, and
merges bit for bit as the whole upload does. An upload in parts left unfinished does not
hold its round's close, even while its reader holds the sum."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient
from fedtrain.participant.client.upload_parts import WHOLE_DIGEST_HEADER, BodyParts
from fedtrain.wire import DIGEST_HEADER, EncodedBody, digest_bytes
from tests.helpers.config import PTOKEN
from tests.helpers.part_uploads import PART, delta_of, merged, parts_config, reference

KEY = "X-Fedtrain-Participant-Key"


class RawParts:
    """Participant `pid` sending the parts of `update` one request at a time, as it chooses."""

    def __init__(self, c: BackgroundCoordinator, client: CoordinatorClient, pid: str,
                 update: dict[str, torch.Tensor]) -> None:
        client.join(pid)
        self.pid = pid
        self.body = EncodedBody(update)
        self.data = b"".join(bytes(x) for x in self.body)
        self.parts = BodyParts(self.body, PART)
        self.http = httpx.Client(base_url=c.url, timeout=30, headers={
            "Authorization": f"Bearer {PTOKEN}", KEY: client.participant_key(pid) or ""})

    def put(self, index: int) -> httpx.Response:
        start, stop = self.parts.span(index)
        return self.http.put(f"/v1/rounds/0/updates/{self.pid}", content=self.data[start:stop],
                             params={"tokens": 100, "part": index, "total": len(self.data), "part_bytes": PART},
                             headers={DIGEST_HEADER: digest_bytes(self.data[start:stop]),
                                      WHOLE_DIGEST_HEADER: self.body.digest()})

    def close(self) -> None:
        self.http.close()


def until(what: str, ok, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_intake_reads_the_parts_as_they_arrive_and_the_update_merges_bit_for_bit(tmp_path: Path) -> None:
    want = reference(tmp_path)
    with BackgroundCoordinator(tmp_path / "state", parts_config()) as c, CoordinatorClient(c.url, PTOKEN) as client:
        p0 = RawParts(c, client, "p0", delta_of(c))
        try:
            last = p0.parts.count - 1
            assert last >= 3
            for i in range(last):
                r = p0.put(i)
                assert r.status_code == 200 and r.json()["parts_complete"] is False, r.text
            # before the last part: the body's header is read and its place chosen (the round's
            # first plain update: into the sum), and nothing is counted yet
            until("the parts held were not read", lambda: c.service.intake.last_path is not None)
            assert c.service.intake.receiving_direct == "p0"
            assert c.service.submissions(0) == []
            answer = p0.put(last).json()
            assert answer["accepted"] is True and answer["parts_complete"] is True, answer
            assert [s["participant_id"] for s in c.service.submissions(0)] == ["p0"]
            got = merged(c, client)
        finally:
            p0.close()
    assert want.keys() == got.keys()
    for n in want:
        assert torch.equal(want[n], got[n]), n


def test_an_upload_in_parts_left_unfinished_does_not_hold_its_rounds_close(tmp_path: Path) -> None:
    cfg = parts_config(round_timeout_s=1.0)
    with BackgroundCoordinator(tmp_path / "state", cfg) as c, CoordinatorClient(c.url, PTOKEN) as client:
        p0 = RawParts(c, client, "p0", delta_of(c))
        try:
            assert p0.put(0).status_code == 200 and p0.put(1).status_code == 200  # and no more: its link died
            until("the parts held were not read", lambda: c.service.intake.receiving_direct == "p0")
            client.join("p1")
            update = {n: torch.full_like(t, 1e-3) for n, t in c.service.inspect().weights.items()}
            assert client.upload(0, "p1", EncodedBody(update), tokens=100)["accepted"] is True
            until("the round never committed", lambda: c.service.inspect().committed_version >= 1)
            assert [s["participant_id"] for s in c.service.submissions(0)] == ["p1"]
            assert c.service.intake.receiving_direct is None  # p0's reader gave the sum up at the close
            assert p0.put(2).status_code == 409  # its round is gone
        finally:
            p0.close()
