"""Streaming DiLoCo on the coordinator, over loopback (docs/streaming.md): with K = 2, round r
syncs fragment r mod 2 only. Two participants upload fragment-only deltas; each round moves
its fragment's weights, exactly by a hand-computed reference (one torch Nesterov SGD per
fragment on the token-weighted mean), and nothing else. An upload with other tensors gets a
400 naming the round's fragment. A coordinator stopped mid-cycle, one crashed right after a
commit, one whose commit failed and one rolled back by the admin all go on with the right
fragment and each fragment's own momentum, bit for bit as a run that never stopped."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

from fedtrain import faults
from fedtrain.cli.report import format_status
from fedtrain.config import RunConfig, outer_defaults
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.merge import build_torch_optimizer
from fedtrain.merge.robust import aggregate_tensor
from fedtrain.streaming import fragments
from fedtrain.wire import DIGEST_HEADER, read_tensors
from tests.helpers.api import assert_error, client, put
from tests.helpers.config import ATOKEN, tiny_config

ROUNDS = 4
TOKENS = {"p": 100, "q": 300}  # uploaded in this order: the mean is (Δp + 3·Δq) / 4


def streaming_config(rounds: int = ROUNDS) -> RunConfig:
    return tiny_config(rounds=rounds, train={"sync_every": 4}, model={"n_layer": 2},
                       streaming={"fragments": 2, "assign": "strided", "overlap": 1, "alpha": 0.5})


def delta(names: list[str], shapes: dict[str, torch.Size], who: str, round_: int) -> dict[str, torch.Tensor]:
    """A participant's Δ over the round's fragment: small multiples of 2^-12, so that the
    token-weighted mean is exact however it is summed (the reference needs no fold order)."""
    g = torch.Generator().manual_seed(100 * round_ + (who == "q"))
    return {n: torch.randint(-64, 65, shapes[n], generator=g).float() * 2.0**-12 for n in names}


class Reference:
    """The run by hand: the global weights, and one torch Nesterov SGD per fragment."""

    def __init__(self, start: dict[str, torch.Tensor], frags: list[list[str]], cfg: RunConfig) -> None:
        self.weights = {n: t.clone() for n, t in start.items()}
        hp = outer_defaults(cfg)
        assert (cfg.outer.algorithm, hp["momentum"], hp["nesterov"]) == ("diloco", 0.9, True)
        self.frags = frags
        self.opts = [build_torch_optimizer([self.weights[n] for n in f], "diloco", hp) for f in frags]

    def round(self, round_: int, deltas: dict[str, dict[str, torch.Tensor]]) -> None:
        p = round_ % len(self.frags)
        total = sum(TOKENS.values())
        for n in self.frags[p]:
            self.weights[n].grad = sum(TOKENS[w] * deltas[w][n] for w in TOKENS) / total
        self.opts[p].step()
        for n in self.frags[p]:
            self.weights[n].grad = None


def download(http: httpx.Client) -> tuple[int, dict[str, torch.Tensor]]:
    r = http.get("/v1/model")
    assert r.status_code == 200, r.text
    tensors = dict(read_tensors([r.content], expected_digest=r.headers[DIGEST_HEADER]))
    return int(r.headers["X-Fedtrain-Version"]), tensors


def wait_committed(c: BackgroundCoordinator, version: int) -> None:
    deadline = time.monotonic() + 30
    while c.service.inspect().committed_version < version:
        assert time.monotonic() < deadline, f"version {version} was never committed"
        time.sleep(0.02)


def sync(c: BackgroundCoordinator, http: httpx.Client, round_: int, frags: list[list[str]],
         shapes: dict[str, torch.Size]) -> dict[str, dict[str, torch.Tensor]]:
    """Both participants upload round `round_`'s fragment, p first; returns once it is committed."""
    names = frags[round_ % len(frags)]
    deltas = {w: delta(names, shapes, w, round_) for w in TOKENS}
    for w in TOKENS:
        r = put(http, round_, w, deltas[w], tokens=TOKENS[w])
        assert r.status_code == 200 and r.json()["accepted"], r.text
    wait_committed(c, round_ + 1)
    return deltas


def joined(c: BackgroundCoordinator) -> tuple[httpx.Client, list[list[str]], dict[str, torch.Size]]:
    http = client(c)
    answers = [http.post("/v1/join", json={"name": w}).json() for w in TOKENS]
    frags = answers[0]["streaming"]["fragments"]
    shapes = {n: torch.Size(s["shape"]) for n, s in answers[0]["model"].items()}
    return http, frags, shapes


def test_each_round_moves_only_its_fragment_by_the_reference_step(tmp_path: Path) -> None:
    cfg = streaming_config()
    with BackgroundCoordinator(tmp_path / "s", cfg) as c:
        http, frags, shapes = joined(c)
        names = list(c.service.inspect().weights)  # the model's order
        assert http.post("/v1/join", json={"name": "p"}).json()["streaming"] == {"fragments": frags, "k": 2}
        assert frags == fragments(names, 2, "strided")
        assert "wte.weight" in frags[0] and any(n.startswith("blocks.1.") for n in frags[1])
        _, start = download(http)
        ref = Reference(start, frags, cfg)
        # round 0 syncs fragment 0: fragment 1's tensors, or the whole model, are refused
        wrong = delta(frags[1], shapes, "p", 0)
        err = assert_error(put(http, 0, "p", wrong), 400, "wrong_fragment")
        assert "round 0 syncs fragment 0 of 2" in err["message"] and err["details"]["fragment"] == 0
        assert err["details"]["missing"] == frags[0] and err["details"]["unexpected"] == frags[1]
        whole = {**delta(frags[0], shapes, "p", 0), **wrong}
        err = assert_error(put(http, 0, "p", whole), 400, "wrong_fragment")
        assert err["details"]["missing"] == [] and err["details"]["unexpected"] == frags[1]
        assert c.service.inspect().submitted == {}
        for r in range(ROUNDS):
            info = http.get(f"/v1/rounds/{r}").json()
            status = http.get("/v1/status").json()
            assert info["fragment"] == r % 2 and status["fragment"] == r % 2
            if r == 1:  # `fedtrain status`: the open round's fragment, and each committed round's
                text = format_status(status)
                assert "round 1/4 (fragment 1 of 2)" in text and "(streaming: K=2, τ=1, α=0.5)" in text
                assert text.splitlines()[-3].split()[:2] == ["round", "fragment"], text
            before = download(http)[1]
            ref.round(r, sync(c, http, r, frags, shapes))
            version, after = download(http)
            assert version == r + 1
            for n in names:
                if n in frags[r % 2]:
                    assert torch.equal(after[n], ref.weights[n]), (r, n)
                else:  # the other fragment: exactly as it was
                    assert torch.equal(after[n], before[n]), (r, n)
            if r == 0:  # the outer state is fragment 0's only: fragment 1 has not synced yet
                assert {k.split("/", 1)[1] for k in c.service.inspect().outer_state} == set(frags[0])
        status = http.get("/v1/status").json()
    assert [x["fragment"] for x in sorted(status["recent_rounds"], key=lambda x: x["round"])] == [0, 1, 0, 1]
    assert status["streaming"] == {"k": 2, "overlap": 1, "alpha": 0.5} and status["finished"]


def reference_run(frags: list[list[str]], shapes: dict[str, torch.Size], start: dict[str, torch.Tensor],
                  cfg: RunConfig) -> dict[str, torch.Tensor]:
    ref = Reference(start, frags, cfg)
    for r in range(ROUNDS):
        ref.round(r, {w: delta(frags[r % 2], shapes, w, r) for w in TOKENS})
    return ref.weights


def test_a_restarted_coordinator_goes_on_with_the_right_fragment_and_momentum(tmp_path: Path) -> None:
    """Stopped after round 0 (the open round is fragment 1's, whose optimizer has no state yet),
    then crashed right after round 1's database commit: round 2 opens with fragment 0, and
    round 3 steps fragment 1 with the momentum round 1 left it."""
    cfg, state = streaming_config(), tmp_path / "s"
    with BackgroundCoordinator(state, cfg) as c:
        http, frags, shapes = joined(c)
        start = download(http)[1]
        sync(c, http, 0, frags, shapes)
        http.close()
    with BackgroundCoordinator(state, cfg) as c:  # a clean stop and start, mid-cycle
        http = client(c, ATOKEN)  # (another port: the participants' keys are in another jar; the admin acts for them)
        info = http.get("/v1/rounds/1").json()
        assert (info["current_round"], info["fragment"]) == (1, 1)
        assert_error(put(http, 1, "p", delta(frags[0], shapes, "p", 1)), 400, "wrong_fragment")
        rule = faults.arm(faults.Rule("commit.after_db", "crash", round=1))
        try:
            names = frags[1]
            for w in TOKENS:
                assert put(http, 1, w, delta(names, shapes, w, 1), tokens=TOKENS[w]).json()["accepted"]
            deadline = time.monotonic() + 30
            while rule.fired == 0:
                assert time.monotonic() < deadline, "commit.after_db never fired"
                time.sleep(0.02)
        finally:
            faults.disarm()
        http.close()
    with BackgroundCoordinator(state, cfg) as c:  # round 1 committed in the database before the crash
        http = client(c, ATOKEN)
        status = http.get("/v1/status").json()
        assert (status["current_round"], status["fragment"]) == (2, 0)
        for r in (2, 3):
            sync(c, http, r, frags, shapes)
        final = download(http)[1]
        http.close()
    want = reference_run(frags, shapes, start, cfg)
    for n in want:
        assert torch.equal(final[n], want[n]), n


def test_a_failed_commit_and_an_admin_roll_back_reopen_the_right_fragment(tmp_path: Path) -> None:
    cfg = streaming_config()
    with BackgroundCoordinator(tmp_path / "s", cfg) as c:
        http, frags, shapes = joined(c)
        start = download(http)[1]
        sync(c, http, 0, frags, shapes)
        # round 1's commit fails: the run goes back to round 1, which syncs fragment 1 again
        with faults.inject("commit.before_db", "raise", round=1):
            for w in TOKENS:
                assert put(http, 1, w, delta(frags[1], shapes, w, 1), tokens=TOKENS[w]).json()["accepted"]
            deadline = time.monotonic() + 30
            while not any(e["kind"] == "commit_failed" for e in c.service.event_log()) or c.service.status()["closing"]:
                assert time.monotonic() < deadline, "the commit never failed"
                time.sleep(0.02)
        info = http.get("/v1/rounds/1").json()
        assert (info["current_round"], info["fragment"], c.service.inspect().committed_version) == (1, 1, 1)
        for r in (1, 2, 3):
            sync(c, http, r, frags, shapes)
        final = download(http)[1]
        want = reference_run(frags, shapes, start, cfg)
        assert all(torch.equal(final[n], want[n]) for n in want)
    cfg = streaming_config(rounds=0)
    with BackgroundCoordinator(tmp_path / "r", cfg) as c, client(c, ATOKEN) as admin:
        http, frags, shapes = joined(c)
        start = download(http)[1]
        for r in (0, 1):
            sync(c, http, r, frags, shapes)
        # back to version 1 (round 0's result): round 2 closes with no updates, round 3 syncs fragment 1
        assert admin.post("/v1/admin/rollback", json={"version": 1}).json() == {"version": 3, "restored": 1}
        info = http.get("/v1/rounds/3").json()
        assert (info["current_round"], info["fragment"]) == (3, 1)
        deltas = sync(c, http, 3, frags, shapes)
        final = download(http)[1]
        rounds = {x["round"]: x for x in http.get("/v1/status").json()["recent_rounds"]}
    assert [rounds[r]["fragment"] for r in range(4)] == [0, 1, None, 1]  # the roll back's round took no step
    ref = Reference(start, frags, cfg)  # version 1: round 0's step; fragment 1 without state yet
    ref.round(0, {w: delta(frags[0], shapes, w, 0) for w in TOKENS})
    ref.round(3, deltas)
    for n in final:
        assert torch.equal(final[n], ref.weights[n]), n


def test_a_robust_aggregator_takes_the_rounds_fragment_only(tmp_path: Path) -> None:
    """The median keeps every update on disk until the close and aggregates them tensor by
    tensor: over the round's fragment, and only it moves."""
    cfg = tiny_config(rounds=2, train={"sync_every": 4}, model={"n_layer": 2}, outer={"aggregator": "median"},
                      streaming={"fragments": 2, "overlap": 0})
    with BackgroundCoordinator(tmp_path / "s", cfg) as c:
        http, frags, shapes = joined(c)
        start = download(http)[1]
        for r in (0, 1):
            deltas = sync(c, http, r, frags, shapes)
            after = download(http)[1]
            moved = {n for n in after if not torch.equal(after[n], start[n])}
            assert moved == set(frags[r]), r
            median = {n: aggregate_tensor([deltas[w][n] for w in TOKENS], "median", cfg.outer.trim_fraction)
                      for n in frags[r]}  # (fedtrain's median, checked against its references in test_robust)
            hp = outer_defaults(cfg)
            want = {n: start[n].clone() for n in frags[r]}
            opt = build_torch_optimizer(list(want.values()), "diloco", hp)
            for n, t in want.items():
                t.grad = median[n]
            opt.step()
            assert all(torch.equal(after[n], want[n]) for n in frags[r]), r
            start = after


@pytest.mark.parametrize(("streaming", "words"), [
    ({"fragments": 4}, "4 fragments need at least 4 blocks, and the model has 2"),
    ({"fragments": 2, "assign": [["wte.*", "wpe.*", "blocks.0.*"], ["nothing.*"]]}, "matches no parameter"),
])
def test_an_assignment_that_does_not_fit_the_model_stops_the_start(tmp_path: Path, streaming: dict,
                                                                   words: str) -> None:
    from fedtrain.errors import ConfigError

    cfg = tiny_config(train={"sync_every": 4}, model={"n_layer": 2}, streaming={**streaming, "overlap": 0})
    with pytest.raises(ConfigError, match=words) as e:
        BackgroundCoordinator(tmp_path / "s", cfg)
    assert e.value.message.startswith("streaming: the model's")
    assert not (tmp_path / "s" / "checkpoints" / "global-000000.safetensors").exists()  # nothing was written
