"""Checkpoint files written with O_DIRECT (`transport.direct.DirectWriter`): the same bytes as
through the page cache, tensors whose memory lines up with the file go to the disk from where they
lie, the others are named so `transport.writers.realign` can move them; refusals fall back."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtrain.merge import OuterOptimizer
from fedtrain.transport import direct as direct_io
from fedtrain.transport.direct import DIRECT_ALIGN, REALIGN_MIN, DirectWriter
from fedtrain.transport.writers import realign
from fedtrain.wire import EncodedBody
from fedtrain.wire.files import PendingFile, write_temp

META = {"run": "t", "version": "3"}


@pytest.fixture
def needs_o_direct(tmp_path: Path) -> None:
    """Skips a test of direct writes themselves where tmp_path's file system refuses O_DIRECT
    (the fallback has tests of its own)."""
    if not direct_io.o_direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")


def mixed(seed: int = 0) -> dict[str, torch.Tensor]:
    """Small and large tensors, several dtypes, odd sizes, an empty one."""
    g = torch.Generator().manual_seed(seed)
    return {
        "tiny": torch.randn(3, generator=g),
        "big": torch.randn(REALIGN_MIN // 4 + 1001, generator=g),
        "odd": torch.randn(5001, generator=g),
        "empty": torch.zeros(0),
        "half": torch.randn(REALIGN_MIN // 2 + 3, generator=g).to(torch.bfloat16),
        "wide": torch.randn(300, 1000, generator=g, dtype=torch.float64),
        "big2": torch.randn(REALIGN_MIN // 4 * 2 + 17, generator=g),
        "last": torch.randn(7, generator=g),
    }


def offsets(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> dict[str, int]:
    """Each tensor's offset in the file."""
    body = EncodedBody(tensors, meta)
    out, at = {}, len(body.header)
    for name, t in tensors.items():
        out[name] = at
        at += t.numel() * t.element_size()
    return out


def written(tmp_path: Path, name: str, tensors: dict[str, torch.Tensor], direct: bool = False,
            **kw) -> tuple[bytes, PendingFile]:
    pending = write_temp(tmp_path / name, tensors, META, write=DirectWriter().write if direct else None, **kw)
    pending.commit()
    return (tmp_path / name).read_bytes(), pending


def test_direct_writes_the_same_bytes_and_names_the_misfits(tmp_path: Path, needs_o_direct: None) -> None:
    tensors = mixed()
    plain, p0 = written(tmp_path, "plain", tensors)
    direct, p1 = written(tmp_path, "direct", tensors, direct=True)
    assert direct == plain and p1.digest == p0.digest == EncodedBody(tensors, META).digest()
    assert p0.misfits == {}  # through the page cache nothing is measured
    at = offsets(tensors, META)
    for name, t in tensors.items():
        big = t.numel() * t.element_size() >= REALIGN_MIN
        lined_up = (t.data_ptr() - at[name]) % DIRECT_ALIGN == 0
        if big and not lined_up:
            assert p1.misfits[name] == at[name] % DIRECT_ALIGN
        else:
            assert name not in p1.misfits


def test_tensors_moved_by_realign_go_from_their_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      needs_o_direct: None) -> None:
    """After `realign`, a tensor's memory lines up with its bytes in the file; the writer hands
    its memory to the kernel (no copy through the bounce buffer) and reports no misfits."""
    params = {"a": torch.randn(REALIGN_MIN // 4 + 5), "b": torch.randn(3 * REALIGN_MIN // 4 + 11),
              "s": torch.randn(9)}
    outer = OuterOptimizer(params, "diloco", {"lr": 0.7, "momentum": 0.9, "nesterov": True})
    outer.step({k: torch.full_like(v, 1e-3) for k, v in params.items()})
    state = outer.state_tensors()
    _, first = written(tmp_path, "m1d", outer.params, direct=True)
    _, first_state = written(tmp_path, "s1d", state, direct=True)
    ids = {k: id(v) for k, v in outer.params.items()}
    values = {k: v.clone() for k, v in outer.params.items()}
    momentum = {k: v.clone() for k, v in state.items()}
    realign(outer, DirectWriter(), first.misfits, first_state.misfits)
    assert {k: id(v) for k, v in outer.params.items()} == ids  # same tensors, moved storage
    for k, v in outer.params.items():
        assert torch.equal(v, values[k])
    for k, v in outer.state_tensors().items():
        assert torch.equal(v, momentum[k])

    at = offsets(outer.params, META)
    for name in ("a", "b"):
        assert (outer.params[name].data_ptr() - at[name]) % DIRECT_ALIGN == 0

    calls: list[tuple[int, int]] = []
    real = os.pwrite

    def spy(fd: int, data: memoryview, offset: int) -> int:
        calls.append((np.frombuffer(data, dtype=np.uint8).ctypes.data, len(data)))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", spy)
    plain, _ = written(tmp_path, "plain2", outer.params)
    direct, again = written(tmp_path, "m2d", outer.params, direct=True)
    _, again_state = written(tmp_path, "s2d", outer.state_tensors(), direct=True)
    assert direct == plain and again.misfits == {} and again_state.misfits == {}
    for name in ("a", "b"):
        t = outer.params[name]
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
        from_memory = sum(n for a, n in calls if start <= a < end)
        assert from_memory >= t.numel() * 4 - 2 * DIRECT_ALIGN  # all but the unaligned edges

    # the optimizer goes on with the moved tensors as with the old ones
    twin = OuterOptimizer(params, "diloco", {"lr": 0.7, "momentum": 0.9, "nesterov": True})
    twin.step({k: torch.full_like(v, 1e-3) for k, v in params.items()})
    for opt in (outer, twin):
        opt.step({k: torch.full_like(v, -2e-3) for k, v in params.items()})
    for k in params:
        assert torch.equal(outer.params[k], twin.params[k])


def test_realign_leaves_what_it_cannot_move() -> None:
    params = {"a": torch.randn(1000), "b": torch.randn(1000)}
    outer = OuterOptimizer(params, "fedavg", {"lr": 1.0})
    before = {k: v.data_ptr() for k, v in outer.params.items()}
    realign(outer, DirectWriter(), {"a": 6, "nope": 0}, {"momentum_buffer/a": 0})  # 6: not a float32 boundary
    assert {k: v.data_ptr() for k, v in outer.params.items()} == before
    realign(outer, DirectWriter(), {"b": 8}, {})
    assert outer.params["b"].data_ptr() % DIRECT_ALIGN == 8 and torch.equal(outer.params["b"], params["b"])


@pytest.mark.parametrize("bounce", [DIRECT_ALIGN, 3 * DIRECT_ALIGN, 8 << 20])
def test_bounce_buffer_sizes_and_a_longer_spare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bounce: int) -> None:
    """Every path of the writer (buffer full, flush before a direct piece, padded end) gives the
    same file, also written over a longer file (a spare), which is cut to size."""
    monkeypatch.setattr(direct_io, "BOUNCE_BYTES", bounce)
    monkeypatch.setattr(direct_io, "DIRECT_PIECE", 5 * DIRECT_ALIGN)  # many pieces per tensor
    tensors = mixed(1)
    plain, _ = written(tmp_path, "plain", tensors)
    spare = tmp_path / "spare.tmp"
    spare.write_bytes(b"\xff" * (len(plain) + 3 * DIRECT_ALIGN + 5))
    pending = write_temp(tmp_path / "d", tensors, META, reuse=spare, write=DirectWriter().write)
    assert pending.tmp == str(spare)
    pending.commit()
    assert (tmp_path / "d").read_bytes() == plain
    for n in (1, DIRECT_ALIGN - 1, DIRECT_ALIGN, DIRECT_ALIGN + 1):  # tiny files: one padded block
        small = {"x": torch.arange(n, dtype=torch.uint8)}
        assert written(tmp_path, f"s{n}", small, direct=True)[0] == written(tmp_path, f"p{n}", small)[0]


def test_a_file_system_without_o_direct_gets_the_page_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import fcntl

    tensors = mixed(2)
    plain, _ = written(tmp_path, "plain", tensors)
    real = fcntl.fcntl

    def refuse(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", refuse)
    data, pending = written(tmp_path, "refused", tensors, direct=True)
    assert data == plain and pending.misfits == {}
    assert "cannot be written with O_DIRECT" in caplog.text


def test_a_direct_write_refused_midway_is_written_again_through_the_page_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    tensors = mixed(3)
    plain, _ = written(tmp_path, "plain", tensors)
    real = os.pwrite
    calls = [0]

    def second_refused(fd: int, data: memoryview, offset: int) -> int:
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", second_refused)
    monkeypatch.setattr(direct_io, "BOUNCE_BYTES", 2 * DIRECT_ALIGN)  # many writes
    data, pending = written(tmp_path, "midway", tensors, direct=True)
    assert calls[0] == 2  # refused at the second; then written again through the page cache (no pwrite)
    assert data == plain and pending.digest == EncodedBody(tensors, META).digest()
    assert "cannot be written with O_DIRECT" in caplog.text


def test_a_failing_disk_fails_the_write_and_leaves_no_temp_file(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space"):
        write_temp(tmp_path / "x", mixed(), META, write=DirectWriter().write)
    assert list(tmp_path.iterdir()) == []

    def short(fd: int, data: memoryview, offset: int) -> int:
        return 100  # a short, unaligned write in the middle: refused, not written over

    monkeypatch.setattr(os, "pwrite", short)
    with pytest.raises(OSError, match="direct write"):
        write_temp(tmp_path / "x", mixed(), META, write=DirectWriter().write)
    assert list(tmp_path.iterdir()) == []


def test_the_coordinator_moves_its_tensors_once_then_writes_them_from_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, needs_o_direct: None) -> None:
    """The start's checkpoint names the misfits (every tensor of the tiny model counts here);
    the coordinator moves them, and the round commits after it write every tensor direct."""
    import httpx

    from fedtrain.coordinator import BackgroundCoordinator
    from fedtrain.coordinator.model.checkpoints import CheckpointDir
    from tests.helpers.api import put
    from tests.helpers.config import ATOKEN, tiny_config

    monkeypatch.setattr(direct_io, "REALIGN_MIN", 64)
    seen = []
    real = CheckpointDir.write

    def spy(self, version, *args, **kw):  # type: ignore[no-untyped-def]
        out = real(self, version, *args, **kw)
        seen.append((version, out))
        return out

    monkeypatch.setattr(CheckpointDir, "write", spy)
    with BackgroundCoordinator(tmp_path / "s", tiny_config(rounds=3), fast_io=True) as c, httpx.Client(
            base_url=c.url, headers={"Authorization": f"Bearer {ATOKEN}"}, timeout=30) as http:
        http.post("/v1/join", json={"name": "a"})
        for r in range(2):
            delta = {n: torch.full_like(t, 0.01) for n, t in c.service.inspect().weights.items()}
            assert put(http, r, "a", delta).status_code == 200
            http.get(f"/v1/rounds/{r}", params={"wait": 10})
        deadline = time.monotonic() + 10
        while c.service.inspect().committed_version < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        got = {v: w for v, w in seen}
        assert sorted(got) == [0, 1, 2]
        assert got[0].misfits  # fresh allocations: the start's checkpoint bounced them
        assert got[1].state_misfits  # the momentum, made by the first step
        assert got[2].misfits == {} and got[2].state_misfits == {}
        params = c.service.inspect().checkpoints.load_global(2, got[2].digest)
        for n, t in c.service.inspect().weights.items():
            assert torch.equal(params[n], t)


def test_a_consuming_move_gives_the_old_pages_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """`aligned_copy(consume=True)` copies piece by piece and releases each piece's whole
    pages of the source behind it (they read as zeros then): the move never holds two copies."""
    monkeypatch.setattr(direct_io, "MOVE_PIECE", 3 * direct_io.PAGE + 100)  # pieces that end mid-page
    t = torch.arange(1, 300_001, dtype=torch.float32)
    expected = t.clone()
    moved = direct_io.aligned_copy(t, 1234 * 4, consume=True)
    assert moved is not None and torch.equal(moved, expected)
    assert (moved.data_ptr() - 1234 * 4) % DIRECT_ALIGN == 0
    raw = t.view(torch.uint8)
    first = -t.data_ptr() % direct_io.PAGE
    last = (t.data_ptr() + raw.numel()) // direct_io.PAGE * direct_io.PAGE - t.data_ptr()
    assert last - first > 100 * direct_io.PAGE
    assert not raw[first:last].any()  # every whole page of the source was given back
    assert torch.equal(raw[:first], expected.view(torch.uint8)[:first])  # bytes sharing a page with others stay


def test_a_config_change_between_merge_and_commit_keeps_the_new_optimizers_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """New outer hyperparameters at a round boundary restore the optimizer around the same
    state tensors, while the old one is still being committed: its misfits must not be
    moved (the move gives the old memory back), or the new optimizer loses its momentum."""
    import httpx

    from fedtrain.coordinator import BackgroundCoordinator
    from tests.helpers.api import commit_round_0
    from tests.helpers.config import ATOKEN, tiny_config

    monkeypatch.setattr(direct_io, "REALIGN_MIN", 64)
    with BackgroundCoordinator(tmp_path / "s", tiny_config(rounds=3), fast_io=True) as c, httpx.Client(
            base_url=c.url, headers={"Authorization": f"Bearer {ATOKEN}"}, timeout=30) as http:
        http.post("/v1/join", json={"name": "a"})
        r = http.put("/v1/config", json={"changes": {"outer": {"lr": 0.5}}}).json()
        assert r["effective_round"] == 1  # in force right after round 0's merge, during its commit
        commit_round_0(c, http)
        inside = c.service.inspect()
        assert c.service.status()["outer_lr"] == 0.5 and inside.outer_steps == 1
        saved, _ = inside.checkpoints.load_outer(1)
        live = inside.outer_state
        assert saved.keys() == live.keys()
        for k, v in saved.items():
            assert torch.equal(live[k], v), k  # the momentum survived the old optimizer's commit
            assert v.abs().sum() > 0
