"""Each participant acts only as itself (issue #18 item 7): a participant key from the join
answer, checked on every route that speaks for a participant; a cap of active participants
per token; an evicted participant's token takes no new name at once. Real coordinator on
loopback; each httpx client below is one participant process (its own cookie jar)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator, Tokens
from fedtrain.coordinator.members.auth import KEY_HEADER
from fedtrain.errors import AuthError, CoordinatorError
from fedtrain.faults import InjectedCrash
from fedtrain.participant import CoordinatorClient, Participant, RetryPolicy
from fedtrain.wire import DIGEST_HEADER, EncodedBody
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config
from tests.helpers.tiny import Regression, Small, init_file, inner_steps


def client(c: BackgroundCoordinator, token: str = PTOKEN, key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}", **({KEY_HEADER: key} if key else {})}
    return httpx.Client(base_url=c.url, headers=headers, timeout=30)


def assert_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and {"status", "code", "message", "details"} <= set(body["error"]), body
    assert body["error"]["status"] == status and body["error"]["code"] == code and body["error"]["message"], body
    return body["error"]


def zeros(c: BackgroundCoordinator) -> bytes:
    weights = c.service.inspect().weights
    return b"".join(bytes(v) for v in EncodedBody({n: torch.zeros_like(t) for n, t in weights.items()}))


def put(http: httpx.Client, round_: int, pid: str, body: bytes) -> httpx.Response:
    import hashlib

    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    return http.put(f"/v1/rounds/{round_}/updates/{pid}", params={"tokens": 10}, content=body,
                    headers={DIGEST_HEADER: digest})


def speaking_for(pid: str) -> list[tuple[str, str, dict | None]]:
    """Every route that speaks for participant `pid`, as (method, path, JSON body)."""
    return [
        ("POST", f"/v1/participants/{pid}/heartbeat", {"step": 1}),
        ("POST", f"/v1/participants/{pid}/metrics", {"values": {"loss": 1.0}}),
        ("GET", f"/v1/rounds/0?participant_id={pid}", None),
        ("GET", f"/v1/model?participant_id={pid}", None),
        ("POST", f"/v1/participants/{pid}/leave", None),
    ]


@contextmanager
def run(tmp_path: Path, **config: object) -> Iterator[BackgroundCoordinator]:
    tokens = Tokens([PTOKEN, "tok-2"], ATOKEN)
    with BackgroundCoordinator(tmp_path / "state", tiny_config(**config), tokens=tokens) as c:
        yield c


def test_with_a_shared_token_a_participant_cannot_act_as_another(tmp_path: Path) -> None:
    with run(tmp_path, min_participants=2) as c, client(c) as a, client(c) as b, client(c, ATOKEN) as admin:
        key_a = a.post("/v1/join", json={"name": "a"}).json()["participant_key"]
        key_b = b.post("/v1/join", json={"name": "b"}).json()["participant_key"]
        assert key_a != key_b
        body = zeros(c)
        with client(c, key=key_a) as a_by_header:
            for http in (a, a_by_header):  # the cookie of a's join answer, or a's key in the header
                assert_error(put(http, 0, "b", body), 403, "not_this_participant")
                for method, path, data in speaking_for("b"):
                    err = assert_error(http.request(method, path, json=data), 403, "not_this_participant")
                    assert "acts only as itself" in err["message"]
        assert c.service.inspect().participants["b"].state == "active" and not c.service.inspect().submitted
        assert c.service.metrics() == []
        # the real participants still act as themselves, and the admin for anyone
        assert a.post("/v1/participants/a/heartbeat", json={"step": 1}).status_code == 200
        with client(c, key=key_b) as b_by_header:
            assert b_by_header.post("/v1/participants/b/heartbeat", json={"step": 2}).status_code == 200
        assert put(a, 0, "a", body).json()["accepted"] is True
        assert b.post("/v1/participants/b/metrics", json={"values": {"loss": 2.0}}).status_code == 200
        assert put(b, 0, "b", body).json()["accepted"] is True
        assert b.get("/v1/rounds/0", params={"wait": 10, "participant_id": "b"}).json()["state"] != "open"
        assert b.get("/v1/model", params={"participant_id": "b"}).status_code == 200
        assert admin.post("/v1/participants/b/heartbeat", json={}).status_code == 200
        assert b.post("/v1/participants/b/leave").json() == {"left": True}


def test_every_route_with_a_participant_in_it_checks_its_key(tmp_path: Path) -> None:
    """Walks the OpenAPI schema: a route added later that names a participant (path `{pid}`
    or query `participant_id`) and forgets the check fails here."""
    with run(tmp_path) as c, client(c) as owner, client(c) as other:
        owner.post("/v1/join", json={"name": "p"})
        spec = other.get("/v1/openapi.json").json()
        checked = 0
        for path, ops in spec["paths"].items():
            for method, op in ops.items():
                names = {p["name"] for p in op.get("parameters", [])}
                if "pid" not in names and "participant_id" not in names:
                    continue
                if (op.get("summary") or "").startswith("Admin:"):
                    continue
                url = path.replace("{round_}", "0").replace("{pid}", "p")
                params = {"participant_id": "p"} if "participant_id" in names else {}
                if "tokens" in names:
                    params["tokens"] = 1
                r = other.request(method.upper(), url, params=params, json={} if method != "get" else None)
                assert_error(r, 403, "not_this_participant")
                checked += 1
        assert checked >= 6  # heartbeat, leave, metrics, upload, round wait, model download


def test_participant_keys_survive_a_coordinator_restart_and_are_stored_hashed(tmp_path: Path) -> None:
    with run(tmp_path) as c, client(c) as a:
        key = a.post("/v1/join", json={"name": "a"}).json()["participant_key"]
    stored = b"".join(p.read_bytes() for p in (tmp_path / "state").glob("run.db*"))
    assert key.encode() not in stored  # only its sha256 is kept
    with run(tmp_path) as c, client(c, key=key) as a, client(c) as other:
        assert a.post("/v1/participants/a/heartbeat", json={"step": 3}).status_code == 200
        assert_error(other.post("/v1/participants/a/heartbeat", json={}), 403, "not_this_participant")
        # heard from with its key since the restart: its name is not up for grabs
        r = other.post("/v1/join", json={"name": "a"})
        err = assert_error(r, 409, "name_in_use")
        assert err["details"]["retry_after_s"] > 0 and int(r.headers["Retry-After"]) >= 1
        again = a.post("/v1/join", json={"name": "a"}).json()  # a rejoin as itself keeps its key
        assert again["participant_key"] == key and again["participant_id"] == "a"


def test_a_participant_restarted_with_the_coordinator_takes_its_name_back_without_its_key(tmp_path: Path) -> None:
    """Restarted both (the chained crash tests do this): nobody has shown the key since the
    coordinator came back, so a join without it takes the name and a new key; the old key is dead."""
    with run(tmp_path) as c, client(c) as a:
        old = a.post("/v1/join", json={"name": "a"}).json()["participant_key"]
    with run(tmp_path) as c, client(c) as fresh, client(c, key=old) as stale:
        new = fresh.post("/v1/join", json={"name": "a"}).json()["participant_key"]
        assert new != old
        assert fresh.post("/v1/participants/a/heartbeat", json={}).status_code == 200
        assert_error(stale.post("/v1/participants/a/heartbeat", json={}), 403, "not_this_participant")
        assert any("a new participant key replaces the old one" in e["message"] for e in c.service.event_log(20))


def test_300_joins_from_one_token_stop_at_its_cap(tmp_path: Path) -> None:
    with run(tmp_path) as c, client(c) as http, client(c, "tok-2") as other:
        answers = [http.post("/v1/join", json={"name": f"sybil-{i}"}) for i in range(300)]
        assert [r.status_code for r in answers].count(200) == 64  # max_participants_per_token's default
        err = assert_error(answers[64], 403, "too_many_participants")
        assert "max_participants_per_token (64)" in err["message"]
        assert all(r.status_code == 403 for r in answers[64:])
        assert len(c.service.inspect().participants) == 64
        assert c.service.round_info(0)["n_active"] == 64  # the round waits for 64, not for 300
        assert other.post("/v1/join", json={"name": "honest"}).status_code == 200  # another token is not held up
        assert http.post("/v1/participants/sybil-0/leave").status_code == 200  # a place is free again
        assert http.post("/v1/join", json={"name": "sybil-300"}).status_code == 200
        assert_error(http.post("/v1/join", json={"name": "sybil-301"}), 403, "too_many_participants")


def test_a_failed_participant_does_not_come_back_past_its_tokens_cap(tmp_path: Path) -> None:
    """Else a token could join its cap, let them fail, join as many again and revive them all."""
    with run(tmp_path, max_participants_per_token=2) as c, client(c) as http:
        for name in ("p0", "p1"):
            assert http.post("/v1/join", json={"name": name}).status_code == 200
        c.service.inspect().participants["p0"].last_seen -= 10_000  # silent for longer than heartbeat_timeout_s
        c.service.tick()
        assert c.service.inspect().participants["p0"].state == "failed"
        assert http.post("/v1/join", json={"name": "p2"}).status_code == 200  # the failed one does not count
        assert_error(http.post("/v1/participants/p0/heartbeat", json={}), 403, "too_many_participants")
        assert c.service.inspect().participants["p0"].state == "failed"
        assert http.post("/v1/participants/p2/leave").status_code == 200
        assert http.post("/v1/participants/p0/heartbeat", json={}).json()["state"] == "active"


def test_an_evicted_participant_cannot_come_straight_back_under_another_name(tmp_path: Path) -> None:
    with run(tmp_path, eviction_cooldown_s=600.0) as c, client(c) as bad, client(c) as friend, \
            client(c, ATOKEN) as admin, client(c, "tok-2") as other:
        bad.post("/v1/join", json={"name": "bad"})
        friend.post("/v1/join", json={"name": "friend"})
        assert admin.post("/v1/participants/bad/evict").status_code == 200
        assert_error(bad.post("/v1/join", json={"name": "bad"}), 403, "evicted")
        r = bad.post("/v1/join", json={"name": "bad-again"})
        err = assert_error(r, 403, "evicted_recently")
        assert "'bad'" in err["message"] and int(r.headers["Retry-After"]) > 500
        assert_error(bad.post("/v1/join", json={}), 403, "evicted_recently")  # nor under a generated name
        assert "bad-again" not in c.service.inspect().participants
        # the token's other participant goes on with its key; another token is not concerned
        assert friend.post("/v1/participants/friend/heartbeat", json={}).status_code == 200
        assert friend.post("/v1/join", json={"name": "friend"}).status_code == 200
        assert other.post("/v1/join", json={"name": "newcomer"}).status_code == 200
        real = c.service.clock
        c.service.clock = lambda: real() + 601  # the cool-down is over
        assert bad.post("/v1/join", json={"name": "bad-again"}).status_code == 200
    with run(tmp_path, eviction_cooldown_s=600.0) as c, client(c) as bad:  # the eviction's time was stored
        assert_error(bad.post("/v1/join", json={"name": "bad-3"}), 403, "evicted_recently")


def _train(fed: Participant, model: torch.nn.Module, steps: int) -> None:
    """`steps` inner steps of a participant the test entered itself (SGD on model(x)² of 8 rows)."""
    inner_steps(fed, Regression(rows=8, target="zero").on(model), steps=steps)


def test_the_participant_client_carries_its_key_and_a_key_file_rejoins_as_itself(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = {"rounds": 0, "train": {"sync_every": 2}, "outer": {"algorithm": "fedavg"}}
    key_file = tmp_path / "run" / "participant-key.json"
    quick = RetryPolicy(initial_s=0.1, max_backoff_s=0.2, max_elapsed_s=0.5)
    with BackgroundCoordinator(tmp_path / "state", tiny_config(**cfg), init_weights=init_file(tmp_path, Small()),
                               tokens=Tokens([PTOKEN], ATOKEN)) as c:
        model = Small()
        first = Participant(CoordinatorClient(c.url, PTOKEN), model=model, name="site", key_file=key_file)
        first.__enter__()  # a process that is then killed: it never leaves
        try:
            _train(first, model, 4)  # uploads, waits, downloads, reports, heartbeats: all with its key
            assert first.round == 2 and [h["round"] for h in first.history] == [0, 1]
            assert key_file.stat().st_mode & 0o077 == 0  # readable by its owner only
            # a second process with the same key file: the first is still active, yet it rejoins at once
            client2 = CoordinatorClient(c.url, PTOKEN, retry=quick)
            with Participant(client2, model=Small(), key_file=key_file) as second:  # no name: the file's
                assert second.participant_id == "site"
                assert client2.participant_key("site") == first.client.participant_key("site")
                _train(second, second.model, 2)
                assert second.round == 3
                # without the file the name is in use while its holder lives: refused once the wait is spent
                with pytest.raises(CoordinatorError) as info:
                    Participant(CoordinatorClient(c.url, PTOKEN, retry=quick), model=Small(), name="site").__enter__()
                assert info.value.status == 409 and info.value.code == "name_in_use", info.value
            assert c.service.inspect().participants["site"].state == "left"
        finally:
            first.__exit__(InjectedCrash, InjectedCrash("killed"), None)  # no goodbye
    key = json.loads(key_file.read_text())["participant_key"]
    text = "\n".join(f"{r.getMessage()} {r.args!r} {r.exc_text or ''}" for r in caplog.records)
    assert len(caplog.records) > 20 and key.startswith("fk_") and key not in text  # never logged, even at DEBUG


def test_a_restarted_participant_without_its_key_waits_until_its_old_self_has_failed(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=0, heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0)
    with BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, Small()),
                               tokens=Tokens([PTOKEN], ATOKEN)) as c:
        crashed = CoordinatorClient(c.url, PTOKEN)
        crashed.join("site")
        crashed.heartbeat("site", step=1)  # heard from with its key: its name is held while it lives
        old_key = crashed.participant_key("site")
        waited: list[str] = []
        handler = _Collect(waited)
        logger = logging.getLogger("fedtrain.participant")
        level = logger.level
        logger.setLevel(logging.INFO)  # whatever an in-process CLI test set it to before
        logger.addHandler(handler)
        try:
            restarted = CoordinatorClient(c.url, PTOKEN, retry=RetryPolicy(initial_s=0.2, max_backoff_s=0.5))
            crashed.heartbeat("site", step=2)  # alive a moment ago, whatever the machine's load
            joined = restarted.join("site")  # retried on name_in_use until the old one fails
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        assert joined["participant_id"] == "site" and joined["participant_key"] != old_key
        assert any("in use" in m for m in waited), waited
        assert restarted.heartbeat("site", step=2)["state"] == "active"
        with pytest.raises(AuthError) as info:
            crashed.heartbeat("site", step=3)  # the old process, were it alive, no longer acts
        assert info.value.code == "not_this_participant"
        crashed.close()
        restarted.close()


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into
        self.lock_ = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self.lock_:
            self.into.append(record.getMessage())


def test_a_concurrent_upload_is_answered_429_with_retry_after(tmp_path: Path) -> None:
    """The coordinator's side of the client's 429 retry: the refusal names how long to wait."""
    with run(tmp_path) as c, client(c) as http:
        http.post("/v1/join", json={"name": "a"})
        body = zeros(c)
        gate, entered = threading.Event(), threading.Event()
        original = c.service.receive_update

        async def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
            import asyncio

            entered.set()
            while not gate.is_set():
                await asyncio.sleep(0.01)
            return await original(*args, **kwargs)

        c.service.receive_update = slow  # type: ignore[method-assign]
        first = threading.Thread(target=lambda: put(http, 0, "a", body))
        first.start()
        try:
            assert entered.wait(10)
            r = put(http, 0, "a", body)
            err = assert_error(r, 429, "upload_in_progress")
            assert r.headers["Retry-After"] == "1" and err["details"]["retry_after_s"] == 1.0
        finally:
            gate.set()
            first.join(timeout=30)
