"""A download broken on the way resumes where it stopped (`transport/resume.py`): through a
proxy that cuts, silences or corrupts the response after N bytes, on both client paths (straight
into the tensors, and through httpx) and both server paths (fast IO on and off). It fetches only
what was missing (bytes counted at the proxy), the weights are bit-identical to the served
ones, a corrupted body is fetched again whole, and a version that moved on meanwhile is
fetched whole as the new one."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from fedtrain.cli.report import format_status
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient, RetryPolicy
from fedtrain.participant.client import coordinator_client as client_module
from fedtrain.transport import direct_http as fetch
from fedtrain.transport import parallel
from fedtrain.wire import read_tensors, write_file
from tests.helpers.api import commit_round_0
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config
from tests.helpers.faulty_link import Fault, FaultyLink

FAST = RetryPolicy(initial_s=0.05, max_backoff_s=0.2, max_elapsed_s=20)
SLACK = 4096  # response headers of a few attempts


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("resume")
    g = torch.Generator().manual_seed(0)
    params = {"lin.weight": torch.randn(1000, 700, generator=g), "lin.bias": torch.randn(1000, generator=g),
              "head.weight": torch.randn(3, 5, generator=g)}
    path = tmp / "init.safetensors"
    write_file(path, params)
    with BackgroundCoordinator(tmp / "s", tiny_config(), init_weights=path) as c:
        whole = c.service.inspect().checkpoints.global_path(0).read_bytes()
        yield c, len(whole), dict(read_tensors([whole]))


def port_of(c: BackgroundCoordinator) -> int:
    return int(c.url.rsplit(":", 1)[1])


def download_through(c: BackgroundCoordinator, faults: list[Fault | None], direct: bool,
                     monkeypatch: pytest.MonkeyPatch, **kw: object) -> tuple[dict, FaultyLink]:
    """A download through a `FaultyLink` whose connections after the first (a health check, so that
    the client has reached the coordinator: a first contact that fails is probed for TLS) meet
    `faults`; the link's `down` then counts the download's bytes only."""
    monkeypatch.setattr(client_module, "is_direct", lambda u: direct)
    with FaultyLink("127.0.0.1", port_of(c), [None, *faults]) as link:
        with CoordinatorClient(link.url, PTOKEN, retry=FAST) as first:
            first.health()
            cl = first.clone()  # its own connections: the download's are the next ones
        link.down = 0
        with cl:
            version, tensors = cl.download(**kw)  # type: ignore[arg-type]
    assert version == 0
    link.connections -= 1
    return tensors, link


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("cut_at", [0.4, 0.001])  # in the data; in the header
def test_a_cut_download_resumes_and_fetches_only_the_rest(served, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                          caplog: pytest.LogCaptureFixture,
                                                          direct: bool, cut_at: float) -> None:
    c, size, want = served
    faults = [Fault("cut", int(size * cut_at) + 300), Fault("cut", int(size * 0.3))]  # twice (bytes of each response)
    with caplog.at_level(logging.INFO, "fedtrain.participant"):
        got, link = download_through(c, faults, direct, monkeypatch, version=0)
    assert same(got, want)
    assert link.connections == 3
    assert size <= link.down <= size + SLACK, (link.down, size)  # nothing fetched twice
    assert sum("resumes at byte" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize("direct", [True, False])
def test_a_silent_download_is_given_up_and_resumed(served, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                   direct: bool) -> None:
    c, size, want = served
    got, link = download_through(c, [Fault("silent", size // 2, silent_s=30)], direct, monkeypatch, version=0,
                                 stall_timeout_s=0.5)
    assert same(got, want)
    # A read that times out loses what it had read of its buffer (Python's buffered socket
    # reader raises without the count): at most one read (READ_BYTES) is fetched again.
    assert link.connections == 2 and size <= link.down <= size + fetch.READ_BYTES + SLACK


@pytest.mark.parametrize("direct", [True, False])
def test_a_corrupted_body_is_fetched_again_whole(served, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                 direct: bool) -> None:
    c, size, want = served
    faults = [Fault("cut", size // 2), Fault("flip", 500)]  # the flip lands in the resumed part
    got, link = download_through(c, faults, direct, monkeypatch, version=0)
    assert same(got, want)  # three attempts (httpx may send the third on the second's connection)
    assert size + size // 2 <= link.down <= 2 * size + SLACK  # half, the (bad) other half, then all


@pytest.mark.parametrize("fast_io", [True, False])
def test_a_version_that_moved_on_is_fetched_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  fast_io: bool) -> None:
    """The newest version, cut halfway; version 1 commits before the retry: its If-Range no
    longer matches, the coordinator sends version 1 whole (200) and the download starts over."""
    with BackgroundCoordinator(tmp_path / "s", tiny_config(rounds=3), fast_io=fast_io) as c, \
            httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {ATOKEN}"}, timeout=30) as http:
        http.post("/v1/join", json={"name": "a"})
        size0 = len(http.get("/v1/model").content)
        cut = Fault("cut", size0 // 2, before=lambda: commit_round_0(c, http))
        with FaultyLink("127.0.0.1", port_of(c), [cut]) as link:
            monkeypatch.setattr(client_module, "is_direct", lambda u: fast_io)
            with CoordinatorClient(link.url, PTOKEN, retry=FAST) as cl:
                version, got = cl.download()
        assert version == 1
        new = http.get("/v1/model", params={"version": 1}).content
        assert same(got, dict(read_tensors([new])))
        assert link.down >= size0 // 2 + len(new)


@contextlib.contextmanager
def a_32mb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[tuple]:
    """A coordinator serving a 32 MB model (more than the socket buffers on the way hold, so that
    it is still sending when the link breaks), participant `name` joined, and an admin client:
    (coordinator, admin, the model body's size, pid, its key). Downloads go the direct path."""
    path = tmp_path / "init.safetensors"
    write_file(path, {"w": torch.randn(4000, 2000, generator=torch.Generator().manual_seed(0))})
    monkeypatch.setattr(client_module, "is_direct", lambda u: True)
    with BackgroundCoordinator(tmp_path / "s", tiny_config(), init_weights=path) as c, \
            CoordinatorClient(c.url, PTOKEN) as joiner, \
            httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {ATOKEN}"}, timeout=30) as admin:
        size = c.service.inspect().checkpoints.global_path(0).stat().st_size
        pid = joiner.join(name)["participant_id"]
        key = joiner.participant_key(pid)
        assert key is not None
        yield c, admin, size, pid, key


def client_through(link: FaultyLink, pid: str, key: str) -> CoordinatorClient:
    """A client speaking as `pid` through `link` whose next connection is its first download's
    (a health check went first: a first contact that fails is probed for TLS)."""
    with CoordinatorClient(link.url, PTOKEN, retry=FAST) as first:
        first.remember_key(pid, key)
        first.health()
        return first.clone()


def test_a_download_in_flight_shows_in_the_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a participant's download stalls, the status (and `fedtrain status`) shows it in flight,
    down, with its bytes of the total; once it is over, no more."""
    release = threading.Event()
    with a_32mb_run(tmp_path, monkeypatch, "watched") as (c, admin, size, pid, key):
        silent = Fault("silent", size // 3, silent_s=1, before=release.set)
        with FaultyLink("127.0.0.1", port_of(c), [None, silent]) as link, client_through(link, pid, key) as cl:
            result: list[dict] = []
            t = threading.Thread(target=lambda: result.append(cl.download(pid=pid, version=0)[1]), daemon=True)
            t.start()
            assert release.wait(10)
            row = next(p for p in admin.get("/v1/status").json()["participants"] if p["id"] == pid)
            (moving,) = row["transfers"]
            assert moving["direction"] == "down" and moving["total"] == size and 0 < moving["bytes"] < size
            assert moving["what"] == "download of version 0" and moving["connections"] == 1
            shown = format_status(admin.get("/v1/status").json())
            assert "transfers in flight" in shown and "↓ down" in shown and "download of version 0" in shown
            t.join(30)
        assert torch.equal(result[0]["w"], c.service.inspect().weights["w"])
        row = next(p for p in admin.get("/v1/status").json()["participants"] if p["id"] == pid)
        assert row["transfers"] == []
        assert "transfers in flight" not in format_status(admin.get("/v1/status").json())


@pytest.mark.parametrize("cut", [False, True])
def test_a_parallel_download_fetches_ranges_side_by_side(served, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                         cut: bool) -> None:
    """streams=4: the head, then four ranges over four connections; one range cut halfway asks
    again for its rest only. The weights are bit-identical, nothing is fetched twice."""
    c, size, want = served
    monkeypatch.setattr(parallel, "MIN_RANGE", 64 << 10)
    faults: list[Fault | None] = [None, Fault("cut", size // 8)] if cut else []  # the head's passes, a range's not
    got, link = download_through(c, faults, True, monkeypatch, version=0, streams=4)
    assert same(got, want)
    assert link.connections == 1 + 4 + (1 if cut else 0)
    assert size <= link.down <= size + parallel.HEAD_PROBE + SLACK


@pytest.mark.parametrize("direct", [True, False])
def test_a_cut_download_of_rows_resumes(served, monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:  # type: ignore[no-untyped-def]
    """A slice (`rows=`) resumes the same way, under its own validator."""
    c, size, want = served
    rows = {"lin.weight": (100, 900), "head.weight": None}
    got, link = download_through(c, [Fault("cut", size // 4)], direct, monkeypatch, version=0, rows=rows)
    assert torch.equal(got["lin.weight"], want["lin.weight"][100:900])
    assert torch.equal(got["head.weight"], want["head.weight"]) and set(got) == set(rows)
    sliced = 800 * 700 * 4
    assert link.connections == 2 and sliced <= link.down <= sliced + SLACK


def test_a_parallel_download_of_rows(served, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    c, _, want = served
    monkeypatch.setattr(parallel, "MIN_RANGE", 64 << 10)
    got, link = download_through(c, [], True, monkeypatch, version=0, rows={"lin.weight": (100, 900)}, streams=3)
    assert set(got) == {"lin.weight"} and torch.equal(got["lin.weight"], want["lin.weight"][100:900])
    assert link.connections == 1 + 3


def test_a_resumed_download_counts_its_bytes_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The participant's bytes_down counts the bytes it was sent: a download cut halfway and
    resumed counts the model about once (plus what the socket buffers on the way took in before
    the cut), not twice (each request counted the whole model)."""
    with a_32mb_run(tmp_path, monkeypatch, "counted") as (c, admin, size, pid, key):
        with FaultyLink("127.0.0.1", port_of(c), [None, Fault("cut", size // 2)]) as link, \
                client_through(link, pid, key) as cl:
            cl.download(pid=pid, version=0)
            assert link.connections == 3  # the health check, the cut attempt, the resumed one
        # The cut connection's bytes count when the coordinator sees it go, which may come after
        # the resumed download has finished (its writes were still draining into socket buffers).
        deadline = time.monotonic() + 20
        while True:
            row = next(p for p in admin.get("/v1/status").json()["participants"] if p["id"] == pid)
            if not row["transfers"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert row["transfers"] == []
        assert size <= row["bytes_down"] <= size + 12 * 2**20, (row["bytes_down"], size)
