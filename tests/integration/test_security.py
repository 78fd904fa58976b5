"""Security: role checks on every mutating route, revocable participant tokens, tokens never
logged, TLS with a self-signed certificate (server and participant, API and CLI)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import Depends, FastAPI
from fastapi.routing import APIRoute

from fedtrain.coordinator import BackgroundCoordinator, Tokens
from fedtrain.coordinator.members.auth import ROLE_CHECK_ATTR, role_check
from fedtrain.errors import CoordinatorError
from fedtrain.participant import CoordinatorClient, RetryPolicy
from tests.helpers import zygote
from tests.helpers.api import assert_error, client, put, zeros_like_model
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config
from tests.helpers.tiny import Regression, Small, init_file, train
from tests.helpers.tls import make_tls

MUTATING = {"POST", "PUT", "PATCH", "DELETE"}


def _has_role_check(dependant) -> bool:
    return any(getattr(d.call, ROLE_CHECK_ATTR, False) or _has_role_check(d) for d in dependant.dependencies)


def unchecked_mutating_routes(app: FastAPI) -> list[str]:
    """Every route that changes something and has no role-checking dependency."""
    bad = []
    for route in app.routes:
        methods = set(getattr(route, "methods", None) or ())
        if not methods & MUTATING:
            continue
        if not isinstance(route, APIRoute) or not _has_role_check(route.dependant):
            bad.append(f"{sorted(methods & MUTATING)} {getattr(route, 'path', route)}")
    return bad


def test_walker_catches_a_route_without_a_role_check() -> None:
    app = FastAPI()

    @role_check
    def who() -> str:
        return "x"

    @app.post("/checked")
    def checked(ident: str = Depends(who)) -> None: ...

    @app.put("/open")
    def open_route() -> None: ...

    @app.get("/read")
    def read() -> None: ...

    assert unchecked_mutating_routes(app) == ["['PUT'] /open"]


def test_every_mutating_route_has_a_role_check(coordinator: BackgroundCoordinator) -> None:
    app = coordinator.server.config.app
    mutating = [r for r in app.routes if set(getattr(r, "methods", None) or ()) & MUTATING]
    assert len(mutating) >= 8  # join, heartbeat, leave, metrics, upload, config, evict, revoke, ...
    assert unchecked_mutating_routes(app) == []
    # and at run time: no token is 401 on every one of them; a participant token is 403 on admin routes
    with client(coordinator, None) as anon, client(coordinator, PTOKEN) as part:
        part.post("/v1/join", json={"name": "p"})
        for route in mutating:
            path = route.path.replace("{round_}", "0").replace("{pid}", "p")
            for method in sorted(set(route.methods) & MUTATING):
                assert_error(anon.request(method, path, params={"tokens": 1}), 401, "unauthorized")
                if (route.summary or "").startswith("Admin:"):
                    bodies = {"tokens/revoke": {"participant_id": "p"}, "admin/tokens": {"name": "site-x"},
                              "rollback": {"version": 0}}
                    body = next((v for k, v in bodies.items() if k in path), {"changes": {"rounds": 5}})
                    r = part.request(method, path, json=body)
                    assert_error(r, 403)


def test_revoked_token_is_refused_and_stays_revoked(tmp_path: Path) -> None:
    tokens = Tokens(["tok-a", "tok-b"], ATOKEN)
    state = tmp_path / "state"
    with BackgroundCoordinator(state, tiny_config(), tokens=tokens) as c:
        with client(c, "tok-a") as a, client(c, "tok-b") as b, client(c, ATOKEN) as admin:
            a.post("/v1/join", json={"name": "alice"})
            b.post("/v1/join", json={"name": "bob"})
            assert_error(a.get("/v1/admin/tokens"), 403, "admin_only")
            listed = admin.get("/v1/admin/tokens").json()["tokens"]
            assert {t["token_id"]: t["participants"] for t in listed}.values().__len__() == 2
            assert not any("tok-" in json.dumps(t) for t in listed)  # fingerprints only
            assert_error(admin.post("/v1/admin/tokens/revoke", json={}), 400)
            assert_error(admin.post("/v1/admin/tokens/revoke", json={"token_id": "ffffffffffff"}), 404)
            assert_error(admin.post("/v1/admin/tokens/revoke", json={"participant_id": "nobody"}), 404)
            r = admin.post("/v1/admin/tokens/revoke", json={"participant_id": "alice"}).json()
            assert r["evicted"] == ["alice"]
            assert_error(a.post("/v1/participants/alice/heartbeat", json={}), 401, "token_revoked")
            assert_error(a.post("/v1/join", json={"name": "alice2"}), 401, "token_revoked")
            # bob alone now completes the round: alice no longer counts as active
            assert put(b, 0, "bob", zeros_like_model(c)).status_code == 200
            assert b.get("/v1/rounds/0", params={"wait": 10}).json()["state"] == "closed"
            events = [e["kind"] for e in admin.get("/v1/events").json()["events"]]
            assert "revoke" in events
    with BackgroundCoordinator(state, tiny_config(), tokens=Tokens(["tok-a", "tok-b"], ATOKEN)) as c:
        with client(c, "tok-a") as a, client(c, "tok-b") as b, client(c, ATOKEN) as admin:
            assert_error(a.get("/v1/status"), 401, "token_revoked")  # the revocation survived the restart
            assert b.get("/v1/status").status_code == 200
            fp = next(t["token_id"] for t in admin.get("/v1/admin/tokens").json()["tokens"] if t["revoked"])
            from fedtrain.coordinator.members.auth import fingerprint

            assert fp == fingerprint("tok-a")
            assert_error(admin.post("/v1/admin/tokens/revoke", json={"token_id": fingerprint(ATOKEN)}), 400)


def test_tokens_are_never_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd) -> None:
    secret_p, secret_a = "p-" + os.urandom(12).hex(), "a-" + os.urandom(12).hex()
    caplog.set_level(logging.DEBUG)
    torch.manual_seed(0)
    cfg = tiny_config(rounds=2, train={"sync_every": 2})
    tokens = Tokens([secret_p], secret_a)
    with BackgroundCoordinator(tmp_path / "s", cfg, tokens=tokens, init_weights=init_file(tmp_path, Small())) as c:
        train(c.url, "solo", Regression(rows=4, target="zero"), token=secret_p)  # until the run finishes
        for bad in (secret_p + "x", secret_a[:-1], f"{secret_p} {secret_a}"):
            with client(c, bad) as http:
                assert http.get("/v1/status").status_code == 401
        with client(c, secret_a) as admin:
            admin.post("/v1/admin/tokens/revoke", json={"participant_id": "solo"})
        with client(c, secret_p) as http:
            assert http.get("/v1/status").status_code == 401
        with pytest.raises(CoordinatorError):
            CoordinatorClient(c.url, secret_p, retry=RetryPolicy(max_elapsed_s=0.5)).status()
    records = caplog.records
    assert len(records) > 5  # the run did log: joins, rounds, events
    text = "\n".join(f"{r.getMessage()} {r.args!r} {r.exc_text or ''}" for r in records)
    out, err = capfd.readouterr()
    for secret in (secret_p, secret_a):
        assert secret not in text and secret not in out and secret not in err


def test_tls_with_a_self_signed_certificate(tmp_path: Path) -> None:
    ca, cert, key = make_tls(tmp_path / "tls")
    torch.manual_seed(0)
    cfg = tiny_config(rounds=1, train={"sync_every": 2})
    with BackgroundCoordinator(
        tmp_path / "s", cfg, init_weights=init_file(tmp_path, Small()), tls_cert=cert, tls_key=key
    ) as c:
        assert c.url.startswith("https://")
        with CoordinatorClient(c.url, PTOKEN, verify=str(ca)) as trusted:
            assert trusted.status()["current_round"] == 0
        t0 = time.monotonic()
        with CoordinatorClient(c.url, PTOKEN, retry=RetryPolicy(max_elapsed_s=30)) as untrusted:
            with pytest.raises(CoordinatorError) as info:
                untrusted.status()
        assert info.value.code == "tls_error" and "--ca-cert" in info.value.message
        assert time.monotonic() - t0 < 10  # refused at once, not retried for 30 s
        with CoordinatorClient(c.url, PTOKEN, verify=False) as insecure:
            assert insecure.health()["ok"]
        with pytest.raises(httpx.HTTPError):
            httpx.get(c.url.replace("https://", "http://") + "/v1/healthz", timeout=5)
        train(c.url, "tls", Regression(rows=4, target="zero"), verify=str(ca))  # Participant(url, verify=...)
        assert c.service.version == 1


def test_tls_from_the_command_line(tmp_path: Path) -> None:
    ca, cert, key = make_tls(tmp_path / "tls")
    state = tmp_path / "state"
    log = open(tmp_path / "coordinator.log", "wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDTRAIN_")}
    proc = zygote.popen(
        [
            sys.executable,
            "-m",
            "fedtrain",
            "coordinator",
            "--state-dir",
            str(state),
            "--port",
            "0",
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--ca-cert",
            str(ca),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        endpoint = state / "endpoint.json"
        deadline = time.monotonic() + 60
        while not endpoint.is_file():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()
            time.sleep(0.1)
        url = json.loads(endpoint.read_text())["url"]
        assert url.startswith("https://")
        deadline = time.monotonic() + 60
        while "dashboard:" not in (printed := (tmp_path / "coordinator.log").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, printed
            time.sleep(0.1)
        site = state / "participant-tokens" / "site-1.token"
        token = site.read_text().strip()
        # the printed command verifies the coordinator with the CA (issue 31, defect 3)
        assert f"--coordinator {url} --token-file {site} --ca-cert {ca} --data" in printed

        def status(*extra: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "fedtrain", "status", "--coordinator", url, "--token", token, *extra],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )

        ok = status("--ca-cert", str(ca))
        assert ok.returncode == 0 and "round 0" in ok.stdout, ok.stderr
        refused = status()
        assert refused.returncode == 2 and "cannot be verified" in refused.stderr and "Traceback" not in refused.stderr
        assert status("--insecure").returncode == 0
        # an admin's command on this machine: the URL, admin token and CA from the state dir
        admin = subprocess.run([sys.executable, "-m", "fedtrain", "token", "list", "--state-dir", str(state)],
                               capture_output=True, text=True, timeout=60, env=env)
        assert admin.returncode == 0 and "site-1" in admin.stdout, admin.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert token not in (tmp_path / "coordinator.log").read_text()
