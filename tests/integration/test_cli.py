"""The `fedtrain` command: clear errors (never a traceback), status, export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.config import PTOKEN
from tests.helpers.processes import assert_clean_error, fedtrain


def test_coordinator_refuses_bad_config(tmp_path: Path) -> None:
    assert_clean_error(fedtrain("coordinator", "--config", str(tmp_path / "nope.yaml")), "nope.yaml", "does not exist")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  sync_every: 0\n")
    assert_clean_error(
        fedtrain("coordinator", "--config", str(bad), "--state-dir", str(tmp_path / "s")),
        "bad.yaml",
        "train.sync_every",
    )


def test_participant_bad_data_and_no_token(tmp_path: Path) -> None:
    r = fedtrain(
        "participant", "--coordinator", "http://127.0.0.1:9", "--token", "t", "--data", str(tmp_path / "missing")
    )
    assert_clean_error(r, "missing")
    r = fedtrain(
        "participant",
        "--coordinator",
        "http://127.0.0.1:9",
        "--data",
        "stdlib:0/2",
        env={"FEDTRAIN_TOKEN": "", "FEDTRAIN_ADMIN_TOKEN": ""},
    )
    assert_clean_error(r, "no token")


def test_participant_gives_up_on_unreachable_coordinator() -> None:
    r = fedtrain(
        "participant",
        "--coordinator",
        "http://127.0.0.1:9",
        "--token",
        "t",
        "--data",
        "stdlib:0/2",
        "--give-up-after",
        "1",
    )
    assert_clean_error(r, "connection refused at 127.0.0.1:9")
    assert "retried for 1s" in r.stderr  # --give-up-after bounds the first contact too


def test_status_and_export(tmp_path: Path, coordinator: BackgroundCoordinator) -> None:
    r = fedtrain("status", "--coordinator", coordinator.url, "--token", PTOKEN)
    assert r.returncode == 0, r.stderr
    assert "run 'test': round 0/3" in r.stdout
    assert_clean_error(fedtrain("status", "--coordinator", coordinator.url, "--token", "wrong"), "invalid token")

    out = tmp_path / "global.safetensors"
    r = fedtrain("export", "--coordinator", coordinator.url, "--token", PTOKEN, "--out", str(out))
    assert r.returncode == 0, r.stderr
    tensors = load_file(out)
    for name, t in coordinator.service.inspect().weights.items():
        assert torch.equal(tensors[name], t)

    out2 = tmp_path / "from-state.safetensors"
    r = fedtrain("export", "--state-dir", str(coordinator.service.state_dir), "--out", str(out2))
    assert r.returncode == 0, r.stderr
    assert load_file(out2).keys() == tensors.keys()
    assert_clean_error(
        fedtrain("export", "--state-dir", str(tmp_path / "empty"), "--out", str(out2)),
        "not a coordinator state directory",
    )


@pytest.mark.parametrize("cmd", ["coordinator", "participant", "demo", "status", "export"])
def test_every_command_has_help(cmd: str) -> None:
    r = fedtrain(cmd, "--help")
    assert r.returncode == 0 and "usage: fedtrain" in r.stdout


def test_export_finds_its_source_in_the_environment(tmp_path: Path, coordinator: BackgroundCoordinator) -> None:
    """Like every client command, export reads FEDTRAIN_COORDINATOR and FEDTRAIN_TOKEN; without a
    coordinator, FEDTRAIN_STATE_DIR is read directly; with neither, one clear line."""
    out = tmp_path / "global.safetensors"
    env = {"FEDTRAIN_COORDINATOR": coordinator.url, "FEDTRAIN_TOKEN": PTOKEN}
    r = fedtrain("export", "--out", str(out), env=env)
    assert r.returncode == 0, r.stderr
    weights = coordinator.service.inspect().weights
    assert all(torch.equal(load_file(out)[n], t) for n, t in weights.items())

    out2 = tmp_path / "from-state.safetensors"
    state_only = {"FEDTRAIN_COORDINATOR": "", "FEDTRAIN_STATE_DIR": str(coordinator.service.state_dir)}
    r = fedtrain("export", "--out", str(out2), env=state_only)
    assert r.returncode == 0, r.stderr
    assert load_file(out2).keys() == weights.keys()

    neither = {"FEDTRAIN_COORDINATOR": "", "FEDTRAIN_STATE_DIR": ""}
    assert_clean_error(fedtrain("export", "--out", str(out2), env=neither), "pass --coordinator URL",
                       "FEDTRAIN_STATE_DIR")
