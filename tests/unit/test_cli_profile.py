"""Where a command finds its coordinator, token and CA (`cli/profile.py`): the flag, else the
environment, else a state directory; an admin command looks for the admin's token first."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from fedtrain.cli import profile
from fedtrain.cli.commands import read_token_file
from fedtrain.errors import FedtrainError

ENV = ("FEDTRAIN_TOKEN", "FEDTRAIN_ADMIN_TOKEN", "FEDTRAIN_TOKEN_FILE", "FEDTRAIN_ADMIN_TOKEN_FILE",
       "FEDTRAIN_COORDINATOR", "FEDTRAIN_STATE_DIR", "FEDTRAIN_CA_CERT")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def args(**given: object) -> argparse.Namespace:
    base = {"coordinator": None, "token": None, "token_file": None, "ca_cert": None, "state_dir": None}
    return argparse.Namespace(**{**base, **given})


def token(a: argparse.Namespace, admin: bool = False) -> str:
    return profile.token(a, read_token_file, admin=admin)


@pytest.fixture()
def state(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir()
    (d / "endpoint.json").write_text(json.dumps({"url": "https://h:1", "pid": 1, "ca_cert": "/ca.pem"}))
    (d / "admin-token").write_text("the-admin\n")
    return d


def test_the_flag_wins_then_the_environment_then_the_state_dir(state: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    a = args(state_dir=state)
    assert profile.coordinator_url(a) == "https://h:1" and profile.ca_cert(a) == "/ca.pem"
    assert token(a, admin=True) == "the-admin"
    monkeypatch.setenv("FEDTRAIN_COORDINATOR", "http://env:2")
    monkeypatch.setenv("FEDTRAIN_CA_CERT", "/env-ca.pem")
    assert profile.coordinator_url(a) == "http://env:2" and profile.ca_cert(a) == "/env-ca.pem"
    given = args(state_dir=state, coordinator="http://flag:3", ca_cert="/flag.pem", token="flag-token")
    assert profile.coordinator_url(given) == "http://flag:3" and profile.ca_cert(given) == "/flag.pem"
    assert token(given, admin=True) == "flag-token"
    site = tmp_path / "site.token"
    site.write_text("site-token\n")
    monkeypatch.setenv("FEDTRAIN_ADMIN_TOKEN_FILE", str(state / "admin-token"))
    monkeypatch.setenv("FEDTRAIN_TOKEN_FILE", str(site))
    assert token(args(), admin=True) == "the-admin" and token(args()) == "site-token"


def test_an_admin_command_prefers_the_state_dirs_admin_token_to_a_participant_token(
    state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEDTRAIN_TOKEN", "site-token")
    assert token(args(state_dir=state), admin=True) == "the-admin"
    assert token(args(state_dir=state)) == "site-token"  # a read: the participant's first
    monkeypatch.setenv("FEDTRAIN_STATE_DIR", str(state))
    assert token(args(), admin=True) == "the-admin"


def test_a_participant_never_reads_a_state_dir(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDTRAIN_STATE_DIR", str(state))
    participant = argparse.Namespace(coordinator=None, token=None, token_file=None, ca_cert=None)  # no --state-dir
    with pytest.raises(FedtrainError, match="no coordinator: pass --coordinator URL or set FEDTRAIN_COORDINATOR$"):
        profile.coordinator_url(participant)
    with pytest.raises(FedtrainError, match="no token"):
        token(participant)
