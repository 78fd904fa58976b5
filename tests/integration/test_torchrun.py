"""torchrun participants (gloo, CPU): rank 0 speaks HTTP, every rank ends on the global weights, no deadlock."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.config import tiny_config
from tests.helpers.torchrun import finish, participant, participant_group, weights


def test_two_rank_torchrun_participant_beside_a_single_process_one(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=3, min_participants=2)  # every round waits for both participants
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        group = participant_group(c.url, "group", "--run-dir", str(tmp_path / "group"))
        out_group = finish(group, participant(c.url, "single", "--run-dir", str(tmp_path / "single")))
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
        rounds = c.service.round_history()
        ranks = {p["id"]: (p["parallel"], p["world_size"]) for p in c.service.status()["participants"]}
        assert c.service.finished and c.service.version == 3
    assert ranks == {"group": ("ddp", 2), "single": ("single", 1)}  # the coordinator sees what each one is
    for r in rounds:  # both took part in every round; the group's tokens are the sum over its 2 ranks
        tokens = {s["participant_id"]: s["tokens"] for s in r["submissions"]}
        assert tokens == {"group": 2 * tokens["single"], "single": tokens["single"]}, tokens
    files = [tmp_path / "group" / "final.safetensors", tmp_path / "group" / "final-rank1.safetensors"]
    files.append(tmp_path / "single" / "final.safetensors")
    for f in files:  # rank 0, rank 1 and the single-process participant all end on the global weights
        w = weights(f)
        assert w.keys() == final.keys() and all(torch.equal(w[k], final[k]) for k in final), f
    assert out_group.count('"world_size": 2') == 2  # both ranks finished and printed their summary


def test_every_rank_stops_when_rank_0_loses_the_coordinator(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=50, train={"sync_every": 10})
    c = BackgroundCoordinator(tmp_path / "state", cfg).start()
    group = participant_group(c.url, "group", "--give-up-after", "2")
    try:
        deadline = time.monotonic() + 120
        while c.service.version < 2:
            assert group.poll() is None and time.monotonic() < deadline, group.stdout.read() if group.stdout else ""
            time.sleep(0.05)
    finally:
        c.stop()
    t0 = time.monotonic()
    out, _ = group.communicate(timeout=120)  # a deadlock would hang here until the timeout
    assert group.returncode != 0
    assert time.monotonic() - t0 < 90
    # rank 1 stops with rank 0's reason (torchrun then ends rank 0, which may not get to print its own)
    assert "fedtrain participant: error: rank 0 of this participant failed: the coordinator" in out, out[-3000:]
    assert "Connection closed by peer" not in out  # rank 1 was told, not cut off in a collective


def test_a_ddp_group_syncs_overlapped_and_every_rank_ends_on_the_global_weights(tmp_path: Path) -> None:
    """`train.overlap`: rank 0 sends at step H and the group trains on; when the round lands, rank 0
    adds the local progress to the new global weights and the other rank takes them (DDP replicas)."""
    cfg = tiny_config(rounds=3, train={"overlap": True})
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        group = participant_group(c.url, "group", "--run-dir", str(tmp_path / "group"))
        out, _ = group.communicate(timeout=240)
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
        rounds = c.service.round_history()
        assert c.service.finished and c.service.version == 3
    assert group.returncode == 0, out[-3000:]
    assert all([s["participant_id"] for s in r["submissions"]] == ["group"] for r in rounds)
    for f in (tmp_path / "group" / "final.safetensors", tmp_path / "group" / "final-rank1.safetensors"):
        w = weights(f)  # the run's end lands on the global model itself, on both ranks
        assert all(torch.equal(w[k], final[k]) for k in final), f
