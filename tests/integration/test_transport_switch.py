"""One setting switches every fast IO path of the coordinator: with it off (`FEDTRAIN_FAST_IO=0`
or `fast_io=False`) the coordinator serves on uvicorn's stock protocol, uploads come as
`receive()` chunks, downloads as a chunked StreamingResponse, and checkpoints are written
without O_DIRECT; with it on, the fast paths serve. A round runs through either way."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.model import publish
from fedtrain.coordinator.model.publish import ModelStream
from fedtrain.transport import FAST_IO_ENV, Body
from fedtrain.transport.readinto import ReadIntoProtocol
from fedtrain.wire import read_tensors
from tests.helpers.api import commit_round_0
from tests.helpers.config import ATOKEN, tiny_config


def spy_on_paths(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Records which path each upload body, download and file write took."""
    seen: dict[str, list[Any]] = {"upload_source": [], "download": [], "o_direct": []}
    body_init, steps, chunks_of = Body.__init__, ModelStream.steps, publish.chunks_of
    real_fcntl, real_open = fcntl.fcntl, os.open

    def body(self: Body, chunks: Any = None, source: Any = None) -> None:
        seen["upload_source"].append(source is not None)
        body_init(self, chunks, source)

    def spy_steps(self: ModelStream, out: Any) -> Any:  # the one body producer, on either path
        seen["download"].append("steps")
        return steps(self, out)

    async def spy_chunks_of(stream: Any) -> Any:  # made by every ModelResponse, run only on the plain path
        seen["download"].append("chunks")
        async for chunk in chunks_of(stream):
            yield chunk

    def spy_fcntl(fd: int, cmd: int, arg: int = 0) -> Any:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            seen["o_direct"].append(fd)
        return real_fcntl(fd, cmd, arg)

    def spy_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if flags & os.O_DIRECT:
            seen["o_direct"].append(path)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(Body, "__init__", body)
    monkeypatch.setattr(ModelStream, "steps", spy_steps)
    monkeypatch.setattr(publish, "chunks_of", spy_chunks_of)
    monkeypatch.setattr(fcntl, "fcntl", spy_fcntl)
    monkeypatch.setattr(os, "open", spy_open)
    return seen


def set_env(monkeypatch: pytest.MonkeyPatch, env: str | None) -> None:
    """FEDTRAIN_FAST_IO set to `env`, or unset (None)."""
    if env is None:
        monkeypatch.delenv(FAST_IO_ENV, raising=False)
    else:
        monkeypatch.setenv(FAST_IO_ENV, env)


def one_round(c: BackgroundCoordinator) -> None:
    """A join, an upload, the round's commit, and a download of the new model."""
    with httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {ATOKEN}"}, timeout=30) as http:
        http.post("/v1/join", json={"name": "a"})
        commit_round_0(c, http)
        r = http.get("/v1/model", params={"version": 1})
        assert r.status_code == 200
        got = dict(read_tensors([r.content]))
        for n, t in c.service.inspect().weights.items():
            assert torch.equal(got[n], t)


@pytest.mark.parametrize("env, override", [("0", None), ("OFF", None), (None, False), ("1", False)])
def test_with_fast_io_off_every_path_is_the_plain_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      env: str | None, override: bool | None) -> None:
    set_env(monkeypatch, env)
    seen = spy_on_paths(monkeypatch)
    with BackgroundCoordinator(tmp_path / "s", tiny_config(rounds=2), fast_io=override) as c:
        assert not c.fast_io
        protocol = c.server.config.http_protocol_class  # uvicorn's stock protocol, capped per address only
        assert protocol.__mro__[1] is HttpToolsProtocol and ReadIntoProtocol not in protocol.__mro__
        one_round(c)
    assert seen["upload_source"] == [False]  # the body came as receive() chunks
    assert seen["download"] == ["chunks", "steps"]  # a StreamingResponse over the steps
    assert seen["o_direct"] == []  # no file opened or switched to O_DIRECT


@pytest.mark.parametrize("env, override", [(None, None), ("yes", None), ("0", True)])
def test_with_fast_io_on_the_fast_paths_serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              env: str | None, override: bool | None) -> None:
    set_env(monkeypatch, env)
    seen = spy_on_paths(monkeypatch)
    with BackgroundCoordinator(tmp_path / "s", tiny_config(rounds=2), fast_io=override) as c:
        assert c.fast_io
        protocol = c.server.config.http_protocol_class
        assert getattr(protocol, "func", None) is ReadIntoProtocol
        one_round(c)
    assert seen["upload_source"] == [True]  # read from the socket into the coordinator's memory
    assert seen["download"] == ["steps"]  # written to the socket from a worker thread
    assert seen["o_direct"]  # the checkpoints went past the page cache (tmp_path takes O_DIRECT here)
