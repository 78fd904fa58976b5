"""Participant tokens per site (issue 31): minted, listed and revoked at run time through the API
and the CLI, kept across restarts as their sha256 only; an eviction shuts out its own site, not
the others; the admin token lives apart, and the printed participant command names one site's
token file, the CA under TLS, and no built-in recipe on an --init-weights run."""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest

from fedtrain.cli import main
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.http.main import next_steps, resolve_tokens, site_token_file
from fedtrain.coordinator.members.auth import Tokens, token_digest
from tests.helpers.api import assert_error, client, commit_round_0
from tests.helpers.config import ATOKEN, tiny_config

NO_ENV = ("FEDTRAIN_TOKEN", "FEDTRAIN_ADMIN_TOKEN", "FEDTRAIN_TOKEN_FILE", "FEDTRAIN_ADMIN_TOKEN_FILE",
          "FEDTRAIN_COORDINATOR", "FEDTRAIN_STATE_DIR", "FEDTRAIN_CA_CERT")


@pytest.fixture(autouse=True)
def _no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NO_ENV:
        monkeypatch.delenv(name, raising=False)


def http(c: BackgroundCoordinator, token: str) -> httpx.Client:
    return httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def mint(admin: httpx.Client, name: str) -> str:
    r = admin.post("/v1/admin/tokens", json={"name": name})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["name"] == name and answer["token_id"] == token_digest(answer["token"])[:12]
    return str(answer["token"])


def join(c: BackgroundCoordinator, token: str, name: str) -> httpx.Response:
    with http(c, token) as h:
        return h.post("/v1/join", json={"name": name})


def test_tokens_are_minted_listed_and_revoked_at_run_time_and_kept_across_restarts(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with BackgroundCoordinator(state, tiny_config(), tokens=Tokens([], ATOKEN)) as c, http(c, ATOKEN) as admin:
        a, b = mint(admin, "site-a"), mint(admin, "site-b")
        assert_error(admin.post("/v1/admin/tokens", json={"name": "site-a"}), 409, "token_name_taken")
        assert join(c, a, "a1").status_code == 200 and join(c, b, "b1").status_code == 200
        listed = {t["name"]: t for t in admin.get("/v1/admin/tokens").json()["tokens"]}
        assert listed["site-a"]["participants"] == ["a1"] and listed["site-b"]["participants"] == ["b1"]
        assert a not in json.dumps(listed) and b not in json.dumps(listed)  # listed by fingerprint only
        shown = {p["id"]: (p["site"], p["token_id"]) for p in admin.get("/v1/status").json()["participants"]}
        assert shown == {"a1": ("site-a", listed["site-a"]["token_id"]), "b1": ("site-b", listed["site-b"]["token_id"])}
        r = admin.post("/v1/admin/tokens/revoke", json={"name": "site-a"}).json()
        assert r == {"revoked": listed["site-a"]["token_id"], "evicted": ["a1"]}
        assert_error(join(c, a, "a2"), 401, "token_revoked")
        assert join(c, b, "b2").status_code == 200
        assert_error(admin.post("/v1/admin/tokens/revoke", json={"name": "site-a"}), 404, "unknown_token")
    with BackgroundCoordinator(state, tiny_config(), tokens=Tokens([], ATOKEN)) as c, http(c, ATOKEN) as admin:
        assert_error(join(c, a, "a3"), 401, "token_revoked")  # the revocation survived the restart
        assert join(c, b, "b3").status_code == 200  # and so did the live token, with no flag or file
        mint(admin, "site-a")  # a revoked token's name may be given to a new token


def test_evicting_one_site_leaves_the_other_sites_joining(tmp_path: Path) -> None:
    with BackgroundCoordinator(tmp_path / "s", tiny_config(), tokens=Tokens([], ATOKEN)) as c, \
            http(c, ATOKEN) as admin:
        a, b = mint(admin, "site-a"), mint(admin, "site-b")
        assert join(c, a, "a1").status_code == 200 and join(c, b, "b1").status_code == 200
        assert admin.post("/v1/participants/a1/evict").status_code == 200
        assert_error(join(c, a, "a2"), 403, "evicted_recently")  # its own site: the cool-down
        assert join(c, b, "b2").status_code == 200  # another site's new participant joins at once
        events = [e["message"] for e in admin.get("/v1/events").json()["events"] if e["kind"] == "evict"]
        assert "'site-a'" in events[-1] and "other tokens are not affected" in events[-1]


def test_tokens_are_stored_hashed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with BackgroundCoordinator(state, tiny_config(), tokens=Tokens([], ATOKEN)) as c, http(c, ATOKEN) as admin:
        token = mint(admin, "site-a")
        assert join(c, token, "a1").status_code == 200
        stored = b"".join(p.read_bytes() for p in state.rglob("*") if p.is_file())  # run.db and its WAL too
        assert token_digest(token).encode() in stored  # what is kept: its sha256
    stored = b"".join(p.read_bytes() for p in state.rglob("*") if p.is_file())
    assert token.encode() not in stored


def _start(state: Path, **flags: object) -> argparse.Namespace:
    return argparse.Namespace(token=None, admin_token=None, **flags)


def test_first_start_mints_one_site_token_apart_from_the_admin_token(tmp_path: Path) -> None:
    state = tmp_path / "state"
    start = resolve_tokens(_start(state), state)
    admin = (state / "admin-token").read_text().strip()
    assert start.tokens.admin == admin and stat.S_IMODE((state / "admin-token").stat().st_mode) == 0o600
    assert not (state / "tokens.json").exists()
    with BackgroundCoordinator(state, tiny_config(), tokens=start.tokens) as c:
        site = site_token_file(state, c.service, start)
        assert site == state / "participant-tokens" / "site-1.token"
        assert stat.S_IMODE(site.stat().st_mode) == 0o600
        token = site.read_text().strip()
        assert token != admin and join(c, token, "p").status_code == 200
        lines = next_steps("http", c.host, c.port, site, state_dir=state)
    printed = "\n".join(lines)
    assert admin not in printed and token not in printed
    assert f"--token-file {site.absolute()}" in lines[0] and "admin-token" not in printed
    # a restart finds the same files: nothing new is minted, the same command is printed
    again = resolve_tokens(_start(state), state)
    with BackgroundCoordinator(state, tiny_config(), tokens=again.tokens) as c:
        assert site_token_file(state, c.service, again) == site and again.tokens.admin == admin
        assert [t["name"] for t in c.service.token_view(c.service.tokens.identify(f"Bearer {admin}"))["tokens"]] \
            == ["site-1"]


def test_a_legacy_tokens_json_keeps_working_as_named_default_tokens(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "tokens.json").write_text(json.dumps({"participant": ["old-p"], "admin": "old-a"}))
    start = resolve_tokens(_start(state), state)
    assert start.tokens.admin == "old-a" and (state / "admin-token").read_text().strip() == "old-a"
    with BackgroundCoordinator(state, tiny_config(), tokens=start.tokens) as c, http(c, "old-a") as admin:
        assert site_token_file(state, c.service, start) is None  # no file with one site's token alone
        assert join(c, "old-p", "p").status_code == 200
        listed = admin.get("/v1/admin/tokens").json()["tokens"]
        assert [(t["name"], t["participants"]) for t in listed] == [("default", ["p"])]
    lines = next_steps("http", "127.0.0.1", 8000, None, state_dir=state)
    assert "tokens.json" not in "\n".join(lines) and "fedtrain token add NAME" in lines[1]


def test_the_printed_command_under_tls_and_on_an_init_weights_run(tmp_path: Path) -> None:
    site, ca = tmp_path / "site-1.token", tmp_path / "ca.pem"
    tls = next_steps("https", "127.0.0.1", 8443, site, ca_cert=ca)
    assert f"--ca-cert {ca.absolute()}" in tls[0] and tls[0].startswith("start a participant: fedtrain participant")
    own = "\n".join(next_steps("http", "127.0.0.1", 8000, site, own_model=True))
    assert "stdlib" not in own and "fedtrain participant " not in own
    assert "own training script" in own and "Participant API" in own and f"--token-file {site.absolute()}" in own


def test_token_and_evict_commands_with_the_url_and_token_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    admin_file = tmp_path / "admin-token"
    admin_file.write_text(ATOKEN + "\n")
    with BackgroundCoordinator(tmp_path / "s", tiny_config(), tokens=Tokens([], ATOKEN)) as c:
        monkeypatch.setenv("FEDTRAIN_COORDINATOR", c.url)
        monkeypatch.setenv("FEDTRAIN_ADMIN_TOKEN_FILE", str(admin_file))
        out = tmp_path / "site-a.token"
        assert main(["token", "add", "site-a", "--out", str(out)]) == 0
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
        token = out.read_text().strip()
        assert token not in capsys.readouterr().out
        assert main(["token", "add", "site-a", "--out", str(out)]) == 2  # never overwrites a token file
        assert "exists already" in capsys.readouterr().err
        assert main(["token", "add", "site-b"]) == 0  # on stdout alone: `> FILE` keeps it
        b = capsys.readouterr().out.strip()
        assert join(c, token, "a1").status_code == 200 and join(c, b, "b1").status_code == 200
        assert main(["token", "list"]) == 0
        listed = capsys.readouterr().out
        assert "site-a" in listed and "a1" in listed and token not in listed and b not in listed
        assert main(["evict", "a1"]) == 0 and "evicted a1" in capsys.readouterr().out
        assert main(["token", "revoke", "site-b"]) == 0 and "evicted: b1" in capsys.readouterr().out
        assert_error(join(c, b, "b2"), 401, "token_revoked")
        # a participant token is refused, in one line, with exit status 2
        assert main(["token", "list", "--token-file", str(out)]) == 2
        err = capsys.readouterr().err
        assert "needs the admin token" in err and "Traceback" not in err
        assert main(["evict", "nobody"]) == 2 and "not part of this run" in capsys.readouterr().err


def test_commands_read_the_coordinator_and_admin_token_of_a_state_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    start = resolve_tokens(_start(state), state)
    with BackgroundCoordinator(state, tiny_config(), tokens=start.tokens) as c:
        (state / "endpoint.json").write_text(json.dumps({"url": c.url, "pid": 0}))
        assert main(["token", "add", "site-a", "--state-dir", str(state), "--out", str(tmp_path / "a")]) == 0
        assert main(["status", "--state-dir", str(state)]) == 0 and "round 0/3" in capsys.readouterr().out
    assert main(["status", "--state-dir", str(tmp_path / "nowhere")]) == 2
    assert "endpoint.json does not exist" in capsys.readouterr().err
    assert main(["status"]) == 2
    assert "no coordinator: pass --coordinator URL or set FEDTRAIN_COORDINATOR" in capsys.readouterr().err


def test_status_watch_follows_the_run_until_it_finishes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with BackgroundCoordinator(tmp_path / "s", tiny_config(rounds=1), tokens=Tokens([], ATOKEN)) as c:

        def finish_the_run() -> None:  # once the watch has printed the open round
            try:
                time.sleep(0.5)
                with client(c, ATOKEN) as admin:
                    assert admin.post("/v1/join", json={"name": "a"}).status_code == 200
                    commit_round_0(c, admin)
            except BaseException:
                os.kill(os.getpid(), signal.SIGINT)  # the watch ends (130) rather than wait forever
                raise

        closer = threading.Thread(target=finish_the_run)
        closer.start()
        try:
            assert main(["status", "--watch", "0.2", "--coordinator", c.url, "--token", ATOKEN]) == 0
        finally:
            closer.join(timeout=30)
    out = capsys.readouterr().out
    assert out.count("run 'test': round 0/1") >= 2  # printed again while the round was open
    assert "(finished)" in out.split("run 'test'")[-1]  # and it ended with the finished run
    assert main(["status", "--watch", "0", "--coordinator", "http://x", "--token", "t"]) == 2
    assert "between 0.2 and 86400" in capsys.readouterr().err
