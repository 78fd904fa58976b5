"""Named participant tokens under hostile use (issue 31): bounded names and a bounded count, a
clear 4xx naming the field; a participant token can neither mint, list nor revoke; and a site
gains nothing by naming its participants after another site's token."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.coordinator.members import site_tokens
from fedtrain.coordinator.members.auth import Tokens
from tests.helpers.api import assert_error
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config


def http(c: BackgroundCoordinator, token: str) -> httpx.Client:
    return httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


@pytest.fixture()
def c(tmp_path: Path) -> BackgroundCoordinator:
    with BackgroundCoordinator(tmp_path / "s", tiny_config(), tokens=Tokens([PTOKEN], ATOKEN)) as coordinator:
        yield coordinator


@pytest.mark.parametrize("body", [
    {"name": ""}, {"name": "x" * 65}, {"name": "-lead"}, {"name": "a b"}, {"name": "site/a"}, {"name": "ä"},
    {"name": 3}, {"name": None}, {}, {"name": "ok", "token": "chosen-by-me"},
])
def test_a_mint_with_a_bad_name_is_a_422_naming_the_field(c: BackgroundCoordinator, body: dict) -> None:
    with http(c, ATOKEN) as admin:
        err = assert_error(admin.post("/v1/admin/tokens", json=body), 422)
        assert "name" in err["message"] or "token" in err["message"]
        assert admin.get("/v1/admin/tokens").json()["tokens"][0]["name"] is None  # nothing minted
        assert len(admin.get("/v1/admin/tokens").json()["tokens"]) == 1
        assert_error(admin.post("/v1/admin/tokens/revoke", json={"name": "x" * 65}), 422)


def test_a_participant_token_cannot_mint_list_or_revoke(c: BackgroundCoordinator) -> None:
    with http(c, ATOKEN) as admin, http(c, PTOKEN) as part:
        token = admin.post("/v1/admin/tokens", json={"name": "site-a"}).json()["token"]
        for site in (part, http(c, token)):
            assert_error(site.post("/v1/admin/tokens", json={"name": "mine"}), 403, "admin_only")
            assert_error(site.get("/v1/admin/tokens"), 403, "admin_only")
            assert_error(site.post("/v1/admin/tokens/revoke", json={"name": "site-a"}), 403, "admin_only")
        assert [t["name"] for t in admin.get("/v1/admin/tokens").json()["tokens"]] == [None, "site-a"]


def test_a_coordinator_holds_at_most_max_tokens(c: BackgroundCoordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(site_tokens, "MAX_TOKENS", 3)
    with http(c, ATOKEN) as admin:
        for name in ("a", "b", "c"):
            assert admin.post("/v1/admin/tokens", json={"name": name}).status_code == 200
        admin.post("/v1/admin/tokens/revoke", json={"name": "c"}).raise_for_status()
        err = assert_error(admin.post("/v1/admin/tokens", json={"name": "d"}), 409, "too_many_tokens")
        assert "revoked ones included" in err["message"]  # a revoked token keeps refusing its holders: kept
        assert len(admin.get("/v1/admin/tokens").json()["tokens"]) == 4  # the one given at start, a, b, c


def test_a_site_gains_nothing_by_naming_its_participants_after_another_sites_token(c: BackgroundCoordinator) -> None:
    with http(c, ATOKEN) as admin:
        a = admin.post("/v1/admin/tokens", json={"name": "site-a"}).json()["token"]
        b = admin.post("/v1/admin/tokens", json={"name": "site-b"}).json()["token"]
        with http(c, a) as site_a, http(c, b) as site_b:
            assert site_b.post("/v1/join", json={"name": "b1"}).status_code == 200
            # site a calls its participant after site b's token, and tries site b's participant's name
            assert site_a.post("/v1/join", json={"name": "site-b"}).status_code == 200
            assert_error(site_a.post("/v1/join", json={"name": "b1"}), 409, "name_taken")
            listed = {t["name"]: t["participants"] for t in admin.get("/v1/admin/tokens").json()["tokens"]}
            assert listed["site-a"] == ["site-b"] and listed["site-b"] == ["b1"]  # bound to its own token
            # evicting site b's participant and revoking site b's token leave site a's "site-b" alone
            admin.post("/v1/participants/b1/evict").raise_for_status()
            assert admin.post("/v1/admin/tokens/revoke", json={"name": "site-b"}).json()["evicted"] == []
            assert site_a.post("/v1/join", json={"name": "a2"}).status_code == 200  # no cool-down for site a
            # and site a's token is what answers for it: revoking it evicts its "site-b"
            evicted = admin.post("/v1/admin/tokens/revoke", json={"name": "site-a"}).json()["evicted"]
            assert sorted(evicted) == ["a2", "site-b"]
