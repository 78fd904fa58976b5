"""The participant's model download and update upload: straight between the socket and the
tensors (`transport.direct_http`), or through httpx where a proxy is configured; both give the
same model, the same sum and the same errors."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.errors import CoordinatorError, CoordinatorUnavailable, RoundClosedError
from fedtrain.participant import CoordinatorClient, RetryPolicy
from fedtrain.participant.client import coordinator_client as client_module
from fedtrain.participant.client import uploads as uploads_module
from fedtrain.transport import direct_http as fetch
from fedtrain.wire import EncodedBody, read_tensors, write_file
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.tls import make_tls

URL = "http://127.0.0.1:8000"


def init_model(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """An initial model of a few tensors, one large enough for many socket reads."""
    g = torch.Generator().manual_seed(0)
    params = {"lin.weight": torch.randn(1000, 700, generator=g), "lin.bias": torch.randn(1000, generator=g),
              "empty": torch.empty(0), "head.weight": torch.randn(3, 5, generator=g)}
    path = tmp_path / "init.safetensors"
    write_file(path, params)
    return path, params


def download_both_ways(c: CoordinatorClient, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, dict]]:
    got = []
    for direct in (True, False):
        monkeypatch.setattr(client_module, "is_direct", lambda url, direct=direct: direct)
        buffers: dict[str, torch.Tensor] = {}

        def allocate(spec, buffers=buffers):  # type: ignore[no-untyped-def]
            buffers[spec.name] = torch.empty(spec.shape, dtype=spec.dtype)
            return buffers[spec.name]

        version, tensors = c.download(allocate=allocate)
        assert all(tensors[n].data_ptr() == buffers[n].data_ptr() for n in tensors if tensors[n].numel())
        got.append((version, tensors))
    return got


def test_direct_and_httpx_downloads_give_the_same_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, params = init_model(tmp_path)
    with BackgroundCoordinator(tmp_path / "s", tiny_config(), init_weights=path) as c:
        served = dict(read_tensors([(c.service.inspect().checkpoints.global_path(0)).read_bytes()]))
        with CoordinatorClient(c.url, PTOKEN) as cl:
            (v1, direct), (v2, via_httpx) = download_both_ways(cl, monkeypatch)
            assert v1 == v2 == 0 and set(direct) == set(via_httpx) == set(params)
            for name in params:
                assert torch.equal(direct[name], served[name]) and torch.equal(via_httpx[name], served[name])

            # an error answer reads the same on both paths
            for direct_path in (True, False):
                monkeypatch.setattr(client_module, "is_direct", lambda url, d=direct_path: d)
                with pytest.raises(CoordinatorError) as info:
                    cl.download(version=7)
                assert info.value.status == 404 and info.value.code == "version_not_kept", direct_path

            c.service.inspect().checkpoints.global_path(0).unlink()  # pruned between the database and the open
            with pytest.raises(CoordinatorError) as info:
                cl.download(version=0)
            assert info.value.status == 404 and info.value.code == "version_not_kept"


def test_direct_download_over_tls(tmp_path: Path) -> None:
    ca, cert, key = make_tls(tmp_path / "tls")
    path, params = init_model(tmp_path)
    with BackgroundCoordinator(tmp_path / "s", tiny_config(), init_weights=path, tls_cert=cert, tls_key=key) as c:
        assert fetch.is_direct(c.url)
        for verify in (str(ca), False):
            with CoordinatorClient(c.url, PTOKEN, verify=verify) as cl:
                version, tensors = cl.download()
                assert version == 0 and torch.equal(tensors["lin.bias"], params["lin.bias"])
        t0 = time.monotonic()
        with CoordinatorClient(c.url, PTOKEN, retry=RetryPolicy(max_elapsed_s=30)) as untrusted:
            with pytest.raises(CoordinatorError) as info:
                untrusted.download()
        assert info.value.code == "tls_error" and "--ca-cert" in info.value.message
        assert time.monotonic() - t0 < 10  # refused at once, not retried for 30 s


def test_direct_and_httpx_uploads_fold_the_same_and_answer_the_same(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path, params = init_model(tmp_path)
    ca, cert, key = make_tls(tmp_path / "tls")
    g = torch.Generator().manual_seed(1)
    delta = {n: torch.randn(t.shape, generator=g) * 1e-3 for n, t in params.items()}
    for tls in (False, True):
        keys = {"tls_cert": cert, "tls_key": key} if tls else {}
        with BackgroundCoordinator(tmp_path / f"s{tls}", tiny_config(min_participants=3), init_weights=path,
                                   **keys) as c, CoordinatorClient(c.url, PTOKEN, verify=str(ca)) as cl:
            pids = [cl.join(name)["participant_id"] for name in ("a", "b", "c")]
            for pid, direct in zip(pids, (True, False)):
                monkeypatch.setattr(uploads_module, "is_direct", lambda url, d=direct: d)  # the upload path
                assert cl.upload(0, pid, EncodedBody(delta), tokens=10) == {
                    "accepted": True, "duplicate": False, "round": 0}
                assert cl.upload(0, pid, EncodedBody(delta), tokens=10)["duplicate"]
            # two of the same update, weight 10 each: the sum holds them over its scale (the first weight)
            summed = c.service.inspect().sum_values
            for n in params:
                assert torch.equal(summed[n], 2 * delta[n]), n
            assert c.service.inspect().sum_weight == 20
            for direct in (True, False):
                monkeypatch.setattr(uploads_module, "is_direct", lambda url, d=direct: d)  # the upload path
                with pytest.raises(RoundClosedError):
                    cl.upload(7, pids[2], EncodedBody(delta), tokens=10)  # answered after the body is read
                with CoordinatorClient(c.url, "not-a-token", verify=str(ca)) as stranger, \
                        pytest.raises(CoordinatorError) as info:
                    stranger.upload(0, pids[2], EncodedBody(delta), tokens=10)  # answered before it is read
                assert info.value.status == 401, direct


def serve_once(respond) -> tuple[str, threading.Thread]:  # type: ignore[no-untyped-def]
    """A one-shot HTTP server on loopback that answers every connection with `respond(conn)`."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(10)
    port = srv.getsockname()[1]

    def run() -> None:
        with srv:
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(65536)
                    respond(conn)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return f"http://127.0.0.1:{port}", t


def test_a_body_cut_short_is_retried_then_reported() -> None:
    body = EncodedBody({"w": torch.randn(100_000)})
    data = b"".join(bytes(c) for c in body)
    calls = []

    def respond(conn: socket.socket) -> None:
        calls.append(1)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Fedtrain-Digest: %s\r\n\r\n"
                     % (len(data), body.digest().encode()) + data[: len(data) // 2])

    url, _ = serve_once(respond)
    with CoordinatorClient(url, PTOKEN, retry=RetryPolicy(initial_s=0.05, max_elapsed_s=0.5)) as cl:
        with pytest.raises(CoordinatorUnavailable) as info:
            cl.download()
    assert len(calls) >= 2  # retried
    assert "WireError" in info.value.message and "truncated" in info.value.message, info.value.message


def test_a_body_whose_digest_differs_is_refused() -> None:
    body = EncodedBody({"w": torch.randn(1000)})
    data = bytearray(b"".join(bytes(c) for c in body))
    data[-1] ^= 1  # one flipped bit in the last value

    def respond(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Fedtrain-Digest: %s\r\n\r\n"
                     % (len(data), body.digest().encode()) + bytes(data))

    url, _ = serve_once(respond)
    with CoordinatorClient(url, PTOKEN, retry=RetryPolicy(initial_s=0.05, max_elapsed_s=0.3)) as cl:
        with pytest.raises(CoordinatorUnavailable) as info:
            cl.download()
    assert "digest" in info.value.message


def test_a_proxy_in_the_environment_sends_downloads_through_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
                "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    assert fetch.is_direct(URL)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    assert not fetch.is_direct(URL)
    assert fetch.is_direct("https://127.0.0.1:8000")  # no HTTPS proxy set
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert fetch.is_direct(URL)
    monkeypatch.setenv("ALL_PROXY", "http://proxy.example:3128")
    monkeypatch.delenv("NO_PROXY")
    assert not fetch.is_direct("https://127.0.0.1:8000")


def test_with_fast_io_off_transfers_go_through_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
                "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FEDTRAIN_FAST_IO", "1")
    assert fetch.is_direct(URL)
    monkeypatch.setenv("FEDTRAIN_FAST_IO", "off")
    assert not fetch.is_direct(URL)  # the plain path: httpx, as with a proxy


def test_the_proxy_check_reads_the_environment_again_when_another_thread_changes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib walks os.environ to find proxies; a variable another thread removes meanwhile is a
    KeyError there (a participant's upload thread died of it while pytest set PYTEST_CURRENT_TEST)."""
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
                "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    real = urllib.request.getproxies
    raced = iter([KeyError("PYTEST_CURRENT_TEST"), RuntimeError("dictionary changed size during iteration")])

    def racy() -> dict[str, str]:
        for error in raced:
            raise error
        return real()

    monkeypatch.setattr(urllib.request, "getproxies", racy)
    assert fetch.is_direct(URL)
    monkeypatch.setattr(urllib.request, "getproxies", lambda: (_ for _ in ()).throw(KeyError("X")))
    with pytest.raises(KeyError):  # (an environment that never holds still: the error, not a guess)
        fetch.is_direct(URL)
