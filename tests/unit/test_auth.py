"""Bearer tokens: roles, wrong schemes, fingerprints that do not reveal the token."""

from __future__ import annotations

from fedtrain.coordinator.members.auth import ADMIN, PARTICIPANT, Tokens, fingerprint


def test_roles() -> None:
    t = Tokens(["p1", "p2"], "adm")
    assert t.identify("Bearer p2").role == PARTICIPANT
    assert t.identify("bearer adm").role == ADMIN
    assert t.identify("Bearer nope") is None
    assert t.identify("Basic p1") is None
    assert t.identify("") is None and t.identify(None) is None
    assert t.identify("Bearer p1").token_id == fingerprint("p1") != "p1"


def test_from_env(monkeypatch) -> None:
    monkeypatch.setenv("FEDTRAIN_TOKEN", "a, b,")
    monkeypatch.setenv("FEDTRAIN_ADMIN_TOKEN", "z")
    t = Tokens.from_env()
    assert t.participant == ["a", "b"] and t.admin == "z"
    assert Tokens.from_env(["x"], "y").participant == ["x"]


def test_generated_tokens_can_follow_an_option_on_a_command_line() -> None:
    """URL-safe base64 starts with "-" one time in 64: argparse then reads `--token -x…` as
    two options ("expected one argument"). A generated token never does."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--token")
    for _ in range(500):
        token = Tokens.generate()
        assert not token.startswith("-") and len(token) >= 32
        assert parser.parse_args(["--token", token]).token == token
