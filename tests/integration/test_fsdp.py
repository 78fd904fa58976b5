"""An FSDP2 participant of 2 ranks (gloo, CPU, torchrun) beside a single-process one: each rank
uploads its own rows as a piece and downloads only its rows; one participant, same weights."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import torch
from safetensors import safe_open

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.config import ATOKEN, tiny_config
from tests.helpers.fsdp import fsdp_group, shards_match
from tests.helpers.processes import wait_for
from tests.helpers.torchrun import finish, participant, weights


def test_two_rank_fsdp_participant_beside_a_single_process_one(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=4, min_participants=2)  # every round waits for both participants
    out = tmp_path / "fsdp"
    out.mkdir()
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        group = fsdp_group(c.url, "group", out)
        finish(group, participant(c.url, "single", "--run-dir", str(tmp_path / "single")))
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
        rounds = c.service.round_history()
        roster = c.service.status()["participants"]
        assert c.service.finished and c.service.version == 4
    assert sorted(p["id"] for p in roster) == ["group", "single"]  # one entry for the 2 ranks
    ranks = {p["id"]: (p["parallel"], p["world_size"]) for p in roster}
    assert ranks == {"group": ("fsdp", 2), "single": ("single", 1)}  # the coordinator sees what each one is
    for r in rounds:  # one submission per round for the group, with the tokens of both ranks
        tokens = {s["participant_id"]: s["tokens"] for s in r["submissions"]}
        assert tokens == {"group": 2 * tokens["single"], "single": tokens["single"]}, tokens
    reports = [json.loads((out / f"rank{k}.json").read_text()) for k in (0, 1)]
    for k, report in enumerate(reports):  # each rank sent its own piece every round; the second completed it
        assert report["participant_id"] == "group"
        assert [h["piece"]["piece"] for h in report["history"]] == [f"rank{k}"] * 4
        assert report["shard_bytes"] < sum(t.numel() * t.element_size() for t in final.values())
    assert all(h["piece"]["pieces"] in (1, 2) for rep in reports for h in rep["history"])
    assert sum(h["piece"]["complete"] for rep in reports for h in rep["history"]) == 4
    covered = {n: 0 for n in final}
    for k in (0, 1):  # the rows each rank ends on are the global model's rows: together, all of it
        with safe_open(str(out / f"rank{k}.safetensors"), "pt") as f:
            rows = json.loads(f.metadata()["rows"])
            for n in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                start, stop = rows[n]
                assert torch.equal(f.get_tensor(n), final[n][start:stop]), (k, n)
                covered[n] += stop - start
    assert covered == {n: t.shape[0] for n, t in final.items()}
    single_w = weights(tmp_path / "single" / "final.safetensors")
    assert all(torch.equal(single_w[k], final[k]) for k in final)
    losses = [h["train_loss"] for h in reports[0]["history"]]
    assert losses[-1] < losses[0], losses  # the loss falls


def test_an_fsdp_group_syncs_overlapped_and_ends_on_the_global_rows(tmp_path: Path) -> None:
    """`train.overlap`: every rank sends its piece at step H and trains on; the round lands as the
    new global rows plus the local progress, and the run's end on the global rows themselves."""
    cfg = tiny_config(rounds=4, train={"overlap": True})
    out = tmp_path / "fsdp"
    out.mkdir()
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        group = fsdp_group(c.url, "group", out)
        text, _ = group.communicate(timeout=240)
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
        rounds = c.service.round_history()
        assert c.service.finished and c.service.version == 4
    assert group.returncode == 0, text[-3000:]
    assert all([s["participant_id"] for s in r["submissions"]] == ["group"] for r in rounds)
    reports = [json.loads((out / f"rank{k}.json").read_text()) for k in (0, 1)]
    for k, report in enumerate(reports):
        assert [h["round"] for h in report["history"]] == [0, 1, 2, 3]
        assert [h["piece"]["piece"] for h in report["history"]] == [f"rank{k}"] * 4
        assert report["overlapped"] == 4  # every round was sent and trained on while it was in flight
    shards_match(out, final)  # the run's end: every rank's rows are the global model's


def test_an_fsdp_group_in_balanced_rounds_is_paced_as_one_and_sees_a_live_config_change_on_every_rank(
        tmp_path: Path) -> None:
    """Balanced rounds with a group throttled by `speed` beside a single process: the group is
    told fewer steps than the faster site, both of its ranks train the same H, and a config changed
    live reaches `on_config_change` on every rank at the same round."""
    h, rows = 8, 8 * 32  # tiny_config: sync_every 8 here, batches of 8 x 32 tokens
    cfg = tiny_config(rounds=5, min_participants=2, train={"sync_every": h}, schedule={"mode": "balanced"},
                      heartbeat_interval_s=0.2)
    out = tmp_path / "fsdp"
    out.mkdir()
    with BackgroundCoordinator(tmp_path / "state", cfg) as c, \
            httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {ATOKEN}"}, timeout=30) as admin:
        group = fsdp_group(c.url, "group", out, "--speed", "0.25")
        single = participant(c.url, "single", "--run-dir", str(tmp_path / "single"))
        wait_for(lambda: c.service.version >= 1 or group.poll() is not None or single.poll() is not None, 240)
        changed = admin.put("/v1/config", json={"changes": {"train": {"lr": 0.002}}})
        assert changed.status_code == 200, changed.text
        effective = changed.json()["effective_round"]
        finish(group, single)
        rounds = sorted(c.service.round_history(), key=lambda r: r["round"])
        assert c.service.finished
    reports = [json.loads((out / f"rank{k}.json").read_text()) for k in (0, 1)]
    told = [[r["sync_every"] for r in rep["history"]] for rep in reports]
    assert told[0] == told[1] and len(told[0]) == 5, told  # a group trains one H, on every rank
    for r in rounds:
        tokens = {s["participant_id"]: s["tokens"] for s in r["submissions"]}
        assert tokens["group"] == 2 * rows * told[0][r["round"]], (r["round"], tokens)  # both ranks' tokens
        if r["round"] >= 1:  # measured by then: the throttled group is told fewer steps than the single site
            assert told[0][r["round"]] < tokens["single"] // rows, (r["round"], told[0], tokens)
    changes = [rep["config_changes"] for rep in reports]
    assert changes[0] == changes[1] and len(changes[0]) == 1, changes  # once, on every rank, alike
    [seen] = changes[0]
    assert seen["lr"] == 0.002 and seen["round"] == effective and any("lr" in f for f in seen["fields"]), seen
