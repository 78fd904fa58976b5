"""Secure aggregation's surface against hostile clients: every route's fields are bounded in the
schema (422), every phase refuses what is out of turn (409), a participant acts only as itself and
only once per step (replays: 409), a masked body of the wrong dtype, shape or session is refused
(400) before it touches the ring sum, and a liar's token claim counts as the round's bound; the
`privacy.secagg_*` fields and the compositions secure aggregation cannot run with are refused with
their reason."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.privacy.round_setup import SECAGG_META
from fedtrain.privacy.shamir import SHARE_BYTES
from fedtrain.privacy.shares import SEALED_BYTES
from tests.helpers.api import assert_error, client, put
from tests.helpers.config import ATOKEN, PTOKEN, tiny_config
from tests.helpers.secagg import Site, ok, run_to_upload

pytest.importorskip("cryptography")

SECAGG = {"secure_aggregation": True, "dp": False, "secagg_max_participants": 4, "secagg_range": 0.5}
TOKENS = {"a": 100, "b": 100, "c": 200}


@pytest.fixture
def run(tmp_path: Path) -> Any:
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy={**SECAGG, "secagg_threshold": 2})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        for pid in TOKENS:
            ok(http.post("/v1/join", json={"name": pid}))
        yield c, http


def zeros(c: BackgroundCoordinator) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in c.service.inspect().weights.items()}


# -- the config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, why", [
    ({"schedule": {"mode": "async"}}, "schedule.mode async"),
    ({"outer": {"aggregator": "median"}}, "outer.aggregator median"),
    ({"outer": {"outlier_factor": 3.0}}, "outer.outlier_factor"),
    ({"outer": {"clip_norm": 1.0}}, "outer.clip_norm"),
    ({"late_uploads": "fold"}, "late_uploads refuse"),
    ({"train": {"compression": "topk"}, "outer": {"algorithm": "fedavg"}}, "train.compression topk"),
    ({"train": {"compression": "e3m0"}}, "train.compression e3m0"),
    ({"train": {"compression": "ternary"}}, "train.compression ternary"),
])
def test_compositions_that_cannot_be_masked_are_refused_with_the_reason(overrides: dict, why: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="privacy.secure_aggregation") as e:
        tiny_config(**overrides, privacy=SECAGG)
    assert why in str(e.value)


@pytest.mark.parametrize("field, value, match", [
    ("secagg_threshold", 1, "greater than or equal to 2"),
    ("secagg_threshold", 5, "at most secagg_max_participants"),
    ("secagg_degree", 1, "greater than or equal to 2"),
    ("secagg_range", 0, "greater than 0"),
    ("secagg_range", float("inf"), "finite number"),
    ("secagg_range", 1e7, "less than or equal"),
    ("secagg_max_participants", 1, "greater than or equal to 2"),
    ("secagg_max_participants", 10**9, "less than or equal to 4096"),
    ("secagg_ring_bits", 8, "16 or 32"),
    ("secagg_precision_bits", 31, "less than or equal to 30"),
    ("secagg_phase_timeout_s", 0, "greater than 0"),
])
def test_every_secagg_number_is_bounded(field: str, value: Any, match: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=match):
        tiny_config(privacy={**SECAGG, field: value})


def test_the_ring_must_hold_the_sum_and_t_its_holders() -> None:
    with pytest.raises(pydantic.ValidationError, match="no ring holds 4096 participants"):
        tiny_config(privacy={**SECAGG, "secagg_max_participants": 4096, "secagg_ring_bits": 16})
    with pytest.raises(pydantic.ValidationError, match=r"at most secagg_degree \+ 1"):
        tiny_config(privacy={**SECAGG, "secagg_degree": 2, "secagg_threshold": 4})
    cfg = tiny_config(privacy={**SECAGG, "secagg_max_participants": 300})  # past 256: the 2^32 ring
    assert cfg.privacy is not None and cfg.privacy.secure_aggregation


# -- the routes: auth, bounds, caps ------------------------------------------------------------------

def test_routes_of_a_run_without_secure_aggregation_answer_409(tmp_path: Path) -> None:
    with BackgroundCoordinator(tmp_path / "s", tiny_config()) as c, client(c, ATOKEN) as http:
        ok(http.post("/v1/join", json={"name": "a"}))
        assert_error(http.get("/v1/rounds/0/secagg", params={"participant_id": "a"}), 409, "secagg_off")


def test_a_participant_speaks_only_for_itself(run: Any) -> None:
    c, _ = run
    with client(c, None) as anon:
        assert_error(anon.get("/v1/rounds/0/secagg"), 401)
        assert_error(anon.post("/v1/rounds/0/secagg/keys/a", json={}), 401)
    session = "0" * 16
    with client(c, PTOKEN) as p:  # a participant token without a's participant key: not a's to speak for
        for route, body in (("keys", {"session": session, "mask": "00" * 32, "channel": "11" * 32, "tokens": 1}),
                            ("shares", {"session": session, "shares": {"2": "00" * SEALED_BYTES}}),
                            ("claim", {"session": session, "tokens": 1}),
                            ("reveal", {"session": session, "shares": [{"owner": 2, "kind": "seed",
                                                                        "share": "00" * SHARE_BYTES}]})):
            r = p.post(f"/v1/rounds/0/secagg/{route}/a", json=body)
            assert r.status_code in (401, 403), (route, r.text)
        for route in ("directory", "mailbox", "unmask"):
            r = p.get(f"/v1/rounds/0/secagg/{route}/a", params={"session": session})
            assert r.status_code in (401, 403), (route, r.text)


BAD_BODIES = [
    ("keys", {"session": "zz", "mask": "00" * 32, "channel": "11" * 32, "tokens": 1}),
    ("keys", {"session": "0" * 16, "mask": "00" * 31, "channel": "11" * 32, "tokens": 1}),
    ("keys", {"session": "0" * 16, "mask": "00" * 32, "channel": "11" * 32, "tokens": -1}),
    ("keys", {"session": "0" * 16, "mask": "00" * 32, "channel": "11" * 32, "tokens": 2**63}),
    ("keys", {"session": "0" * 16, "mask": "00" * 32, "channel": "11" * 32, "tokens": "5"}),
    ("keys", {"session": "0" * 16, "mask": "00" * 32, "channel": "11" * 32, "tokens": 1, "extra": 1}),
    ("claim", {"session": "zz", "tokens": 1}),
    ("claim", {"session": "0" * 16, "tokens": -1}),
    ("claim", {"session": "0" * 16, "tokens": 2**63}),
    ("claim", {"session": "0" * 16}),
    ("claim", {"session": "0" * 16, "tokens": 1, "extra": 1}),
    ("shares", {"session": "0" * 16, "shares": {"1": "00" * (SEALED_BYTES - 1)}}),
    ("shares", {"session": "0" * 16, "shares": {"0": "00" * SEALED_BYTES}}),
    ("shares", {"session": "0" * 16, "shares": {str(i): "00" for i in range(1, 4098)}}),
    ("reveal", {"session": "0" * 16, "shares": [{"owner": 1, "kind": "both", "share": "00"}]}),
    ("reveal", {"session": "0" * 16, "shares": [{"owner": 0, "kind": "seed", "share": "00"}]}),
    ("reveal", {"session": "0" * 16, "shares": [{"owner": 1, "kind": "seed", "share": "00"}] * 4097}),
]


@pytest.mark.parametrize("route, body", BAD_BODIES)
def test_every_body_field_is_bounded_in_the_schema(run: Any, route: str, body: dict) -> None:
    _, http = run
    assert_error(http.post(f"/v1/rounds/0/secagg/{route}/a", json=body), 422, "invalid_request")


@pytest.mark.parametrize("params", [{"wait": 61}, {"wait": -1}, {"phase": "nope"}, {"session": "ABC"},
                                    {"participant_id": "../x"}])
def test_every_query_field_is_bounded(run: Any, params: dict) -> None:
    _, http = run
    assert_error(http.get("/v1/rounds/0/secagg", params=params), 422, "invalid_request")
    assert_error(http.get("/v1/rounds/2**60/secagg"), 422)


def test_a_round_holds_at_most_n_max_participants(tmp_path: Path) -> None:
    cfg = tiny_config(privacy={**SECAGG, "secagg_max_participants": 2})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        for pid in TOKENS:
            ok(http.post("/v1/join", json={"name": pid}))
        Site(http, "a").enrol()
        Site(http, "b").enrol()
        assert_error(http.get("/v1/rounds/0/secagg", params={"participant_id": "c"}), 409, "secagg_full")


# -- out of turn, twice, for someone else --------------------------------------------------------------

def test_replays_and_steps_out_of_turn_are_refused(run: Any) -> None:
    c, http = run
    a, b, cc = (Site(http, pid) for pid in TOKENS)
    for s in (a, b, cc):
        s.enrol()
    ok(a.advertise(100))
    assert a.keys is not None
    first = a.keys.public().to_json()
    replay = http.post("/v1/rounds/0/secagg/keys/a", json={"session": a.session, **first, "tokens": 100})
    assert_error(replay, 409, "secagg_keys")  # twice
    assert_error(http.get("/v1/rounds/0/secagg/directory/a", params={"session": a.session}), 409, "secagg_phase")
    assert_error(http.post("/v1/rounds/0/secagg/shares/a", json={"session": a.session, "shares": {}}), 409,
                 "secagg_phase")
    stolen = http.post("/v1/rounds/0/secagg/keys/b", json={"session": a.session, **first, "tokens": 1})
    assert_error(stolen, 409, "secagg_keys")  # a key another participant uses
    ok(b.advertise(100))
    ok(cc.advertise(200))  # the last active participant: the keys phase closes
    assert_error(Site(http, "a").advertise(100), 409, "secagg_phase")
    ok(a.share())
    assert_error(a.share(), 409, "secagg_shares")  # twice
    assert_error(b.upload(zeros(c)), 409, "secagg_phase")  # an upload before the upload phase: refused, unread
    bad = http.post("/v1/rounds/0/secagg/shares/b", json={"session": a.session, "shares": {"1": "00" * SEALED_BYTES}})
    assert_error(bad, 400, "secagg_shares")  # not one bundle to each neighbour
    ok(b.share())
    ok(cc.share())
    assert_error(http.get("/v1/rounds/0/secagg/mailbox/a", params={"session": "f" * 16}), 409, "secagg_session")
    assert_error(http.get("/v1/rounds/0/secagg/unmask/a", params={"session": a.session}), 409, "secagg_phase")
    assert c.service.status()["secure_aggregation"]["phase"] == "upload"


def test_masked_bodies_of_the_wrong_kind_are_refused_before_the_ring_sum(run: Any) -> None:
    c, http = run
    sites = [Site(http, pid) for pid in TOKENS]
    run_to_upload(sites, TOKENS)
    a = sites[0]
    good = a.masked(zeros(c))
    meta = {SECAGG_META: json.dumps({"session": a.session, "bits": 16})}
    plain = put(http, 0, "a", zeros(c), tokens=100)  # a plain float update
    assert_error(plain, 400)
    wrong_dtype = {n: t.view(torch.int16) for n, t in good.items()}
    assert_error(a.upload(wrong_dtype, meta=meta), 400)
    name = next(iter(good))
    wrong_shape = {**good, name: good[name][:-1]}
    assert_error(a.upload(wrong_shape, meta=meta), 400)
    missing = {n: t for n, t in good.items() if n != name}
    assert_error(a.upload(missing, meta=meta), 400)
    assert_error(a.upload(good, meta={}), 400)  # no session
    other = {SECAGG_META: json.dumps({"session": "0" * 16, "bits": 16})}
    assert_error(a.upload(good, meta=other), 400)
    assert_error(a.upload(good, tokens=101), 400, "secagg_tokens")  # not the claim made with the keys
    assert c.service.status()["submitted"] == []  # none of them counted
    ok(a.upload(good, tokens=100))
    again = a.upload(good, tokens=100)
    assert again.status_code == 200 and again.json()["duplicate"]  # idempotent, not added twice
    r = http.put("/v1/rounds/0/updates/b", params={"tokens": 100, "piece": "r0"}, content=b"x",
                 headers={"X-Fedtrain-Digest": "sha256:" + "0" * 64})
    assert r.status_code in (400, 409), r.text


def test_a_participant_that_did_not_share_cannot_upload_or_reveal(tmp_path: Path) -> None:
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy={**SECAGG, "secagg_threshold": 2,
                                                              "secagg_phase_timeout_s": 0.3})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        for pid in TOKENS:
            ok(http.post("/v1/join", json={"name": pid}))
        a, b, cc = (Site(http, pid) for pid in TOKENS)
        for s in (a, b, cc):
            s.enrol()
            ok(s.advertise(TOKENS[s.pid]))
        ok(a.share())
        ok(b.share())  # c never shares: the phase closes after its timeout with a and b
        _wait_phase(c, "upload")
        assert_error(cc.upload(zeros(c), tokens=200), 409, "secagg_not_member")
        assert_error(http.get("/v1/rounds/0/secagg/mailbox/c", params={"session": cc.session}), 409,
                     "secagg_not_member")


def test_a_survivor_may_not_reveal_what_would_unmask_one_upload(run: Any) -> None:
    c, http = run
    sites = [Site(http, pid) for pid in TOKENS]
    run_to_upload(sites, TOKENS)
    a, b, _ = sites
    for s in (a, b):
        ok(s.upload(s.masked(zeros(c)), TOKENS[s.pid]))
    ok(http.post("/v1/participants/c/leave"))
    _wait_phase(c, "reveal")
    # b survived: a share of its mask key, with its self seed's, would unmask b's upload alone
    lie = {"session": a.session, "shares": [{"owner": b.id, "kind": "key", "share": "01" * SHARE_BYTES}]}
    assert_error(http.post("/v1/rounds/0/secagg/reveal/a", json=lie), 400, "secagg_reveal")
    ok(a.reveal())
    assert_error(a.reveal(), 409)  # twice


# -- what a liar gains ------------------------------------------------------------------------------------

def test_a_token_claim_counts_as_at_most_the_rounds_bound(run: Any) -> None:
    """Weights are public and fixed from the claims (made with the keys, or after the shares): a
    claim past what a round's schedule allows counts as that bound (as a plain upload's does), so a
    liar's weight is the largest an honest participant can have, not more."""
    _, http = run
    sites = [Site(http, pid) for pid in TOKENS]
    for s in sites:
        s.enrol()
    answer = ok(sites[0].advertise(2**62))
    bound = answer["tokens_counted"]
    assert bound < 2**62
    ok(sites[1].advertise(bound))
    ok(sites[2].advertise(None))  # claims after the shares (masks drawn ahead)
    for s in sites:
        ok(s.share())
    assert ok(sites[2].claim(2**62))["tokens_counted"] == bound
    w = sites[0].state()["weights"]
    assert w[str(sites[0].id)] == pytest.approx(w[str(sites[1].id)])  # no more than an honest full claim
    assert w[str(sites[2].id)] == pytest.approx(w[str(sites[1].id)])


def test_a_late_claim_is_made_once_by_a_participant_that_shared_and_fixes_the_weights(run: Any) -> None:
    """Keys without a claim: the weights are not fixed (no upload is taken) until every participant
    that shared has claimed; a second claim, a claim with the keys and again, or a claim of one
    that did not share are refused (409); the upload must repeat the claim (400)."""
    c, http = run
    sites = [Site(http, pid) for pid in TOKENS]
    for s in sites:
        s.enrol()
    a, b, cc = sites
    assert_error(a.claim(100), 409, "secagg_phase")  # no claim in the keys phase: it goes with the keys
    ok(a.advertise(None))
    ok(b.advertise(None))
    ok(cc.advertise(TOKENS["c"]))
    ok(a.share())
    ok(b.share())
    ok(cc.share())
    for s in sites:
        s.receive()  # the mailbox opens with the claims phase: masks can be drawn before training ends
    st = a.state()
    assert st["phase"] == "claims" and st["weights"] is None
    assert_error(cc.claim(TOKENS["c"]), 409, "secagg_claim")  # claimed with its keys
    ring = {n: torch.zeros(t.numel(), dtype=torch.uint16) for n, t in zeros(c).items()}
    assert_error(a.upload(ring, TOKENS["a"]), 409, "secagg_phase")  # no weights yet: refused unread
    ok(a.claim(TOKENS["a"]))
    assert_error(a.claim(TOKENS["a"]), 409, "secagg_claim")  # once
    assert a.state()["phase"] == "claims"  # b has not claimed
    ok(b.claim(TOKENS["b"]))
    st = a.state()
    assert st["phase"] == "upload"
    assert [st["weights"][str(s.id)] for s in sites] == pytest.approx([0.25, 0.25, 0.5])
    assert_error(b.claim(TOKENS["b"]), 409, "secagg_phase")  # the claims phase is closed
    assert_error(b.upload(b.masked(zeros(c)), 101), 400, "secagg_tokens")  # not its claim


def test_a_participant_that_shared_but_never_claimed_is_dropped_at_the_claims_timeout(tmp_path: Path) -> None:
    """With t claims in, the claims phase closes secagg_phase_timeout_s after the first claim
    without the one that never claimed: it has no weight, cannot upload (409), and counts as
    dropped (its pairwise masks are removed with its revealed key)."""
    cfg = tiny_config(outer={"algorithm": "fedavg"}, privacy={**SECAGG, "secagg_threshold": 2,
                                                             "secagg_phase_timeout_s": 0.5})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c, client(c, ATOKEN) as http:
        for pid in TOKENS:
            ok(http.post("/v1/join", json={"name": pid}))
        sites = [Site(http, pid) for pid in TOKENS]
        for s in sites:
            s.enrol()
        for s in sites:
            ok(s.advertise(None))
        for s in sites:
            ok(s.share())
        a, b, late = sites
        ok(a.claim(TOKENS["a"]))
        ok(b.claim(TOKENS["b"]))
        _wait_phase(c, "upload")
        assert set(a.state()["weights"]) == {str(a.id), str(b.id)}
        ring = {n: torch.zeros(t.numel(), dtype=torch.uint16) for n, t in zeros(c).items()}
        assert_error(late.upload(ring, TOKENS["c"]), 409, "secagg_not_member")
        for s in (a, b):
            ok(s.upload(s.masked(zeros(c)), TOKENS[s.pid]))
        _wait_phase(c, "reveal")
        req = ok(http.get(f"{a.base}/unmask/a", params={"session": a.session}))
        assert req["dropped"] == [late.id]
        for s in (a, b):
            ok(s.reveal())
        deadline = time.monotonic() + 10
        while c.service.inspect().committed_version < 1:
            assert time.monotonic() < deadline, c.service.status()["reason"]
            time.sleep(0.02)
        assert c.service.round_history(1)[0]["n_submissions"] == 2


def _wait_phase(c: BackgroundCoordinator, phase: str) -> None:
    deadline = time.monotonic() + 10
    while c.service.status()["secure_aggregation"]["phase"] != phase:
        assert time.monotonic() < deadline, c.service.status()["secure_aggregation"]
        time.sleep(0.02)
