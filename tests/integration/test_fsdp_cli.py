"""`fedtrain participant --parallel fsdp` under torchrun (gloo, CPU): the recipe shards the model
with FSDP2, every rank syncs its own rows, the run directory keeps a DCP checkpoint that a group
killed mid-run resumes from on another number of ranks, and LoRA sends only adapter rows."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fedtrain.config import load_config
from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers import zygote
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.fsdp import fsdp_cli_group
from tests.helpers.torchrun import finished, rank_summaries

H = 5


def rows_of(path: Path) -> dict[str, tuple[torch.Tensor, list[int]]]:
    with safe_open(str(path), "pt") as f:
        rows = json.loads(f.metadata()["fedtrain.rows"])
        return {n: (f.get_tensor(n), rows[n]) for n in f.keys()}  # noqa: SIM118 - safe_open is not a mapping


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def saved_state(run_dir: Path, round_: int) -> dict:
    return json.loads((run_dir / "dcp" / f"round-{round_}" / "state.json").read_text())


def adam_steps(run_dir: Path, round_: int) -> set[float]:
    """AdamW's step counts in the checkpoint of round `round_` (rank 0's file holds the replicated ones)."""
    steps = set()
    for shard in (run_dir / "dcp" / f"round-{round_}" / "optimizer").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            steps |= {float(f.get_tensor(k)) for k in f.keys() if k.endswith("/step")}  # noqa: SIM118
    return steps


def test_fsdp_participant_from_the_cli(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=4)
    run_dir = tmp_path / "group"
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        summaries = rank_summaries(finished(fsdp_cli_group(c.url, "group", run_dir, via="fedtrain")))
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
        roster = c.service.status()["participants"]
        rounds = c.service.round_history()
        assert c.service.finished
    assert [p["id"] for p in roster] == ["group"]  # the 2 ranks are one participant
    assert all([s["participant_id"] for s in r["submissions"]] == ["group"] for r in rounds)
    assert sorted(s["rank"] for s in summaries) == [0, 1]
    assert all(s["parallel"] == "fsdp" and s["rounds"] == 4 for s in summaries)
    for s in summaries:  # every rank holds about half of the model, together all of it
        assert s["param_bytes"] < s["model_param_bytes"]
    assert sum(s["param_bytes"] for s in summaries) == summaries[0]["model_param_bytes"]
    covered = dict.fromkeys(final, 0)
    for k in (0, 1):  # each rank ends on its rows of the global model
        for n, (t, (start, stop)) in rows_of(run_dir / f"final-rank{k}.safetensors").items():
            assert torch.equal(t, final[n][start:stop]), (k, n)
            covered[n] += stop - start
    assert covered == {n: t.shape[0] for n, t in final.items()}
    losses = [m["train_loss"] for m in metrics(run_dir)]
    assert len(losses) == 4 and losses[-1] < losses[0], losses  # the loss falls
    assert saved_state(run_dir, 4)["world_size"] == 2


def test_killed_fsdp_group_resumes_on_one_rank_from_its_last_complete_checkpoint(tmp_path: Path) -> None:
    rounds, killed_at = 4, 2
    # the restarted group rejoins under its name once the killed one is silent (8 s)
    cfg = tiny_config(rounds=rounds, train={"sync_every": H}, heartbeat_timeout_s=8.0)
    run_dir = tmp_path / "group"
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        # rank 0 dies while round 2's checkpoint is half written: every rank's shard is on disk, no state.json
        fault = {"FEDTRAIN_FAULTS": f"participant.checkpoint:kill:round={killed_at}"}
        first = fsdp_cli_group(c.url, "group", run_dir, env=fault)
        out, _ = first.communicate(timeout=240)
        assert first.returncode != 0, out[-3000:]
        partial = run_dir / "dcp" / f".partial-{killed_at}"
        assert len(list((partial / "optimizer").glob("*.safetensors"))) == 2 and not (partial / "state.json").exists()
        before = saved_state(run_dir, killed_at - 1)  # the previous one was kept
        assert before["world_size"] == 2 and before["steps"] == (killed_at - 1) * H
        assert adam_steps(run_dir, killed_at - 1) == {before["steps"]}
        rejoin_round = c.service.version
        assert rejoin_round == killed_at

        second = fsdp_cli_group(c.url, "group", run_dir, nproc=1)
        (summary,) = rank_summaries(finished(second))
        assert c.service.finished
    assert summary["world_size"] == 1 and summary["resumed_from_round"] == killed_at - 1
    new_steps = (rounds - rejoin_round) * H
    assert summary["steps"] == before["steps"] + new_steps  # counters carried over
    after = saved_state(run_dir, rounds)
    assert after["world_size"] == 1 and after["steps"] == before["steps"] + new_steps
    # AdamW went on from its saved step count on the one rank that now holds every row (not from zero)
    assert adam_steps(run_dir, rounds) == {before["steps"] + new_steps}
    assert not partial.exists() and sorted(p.name for p in (run_dir / "dcp").iterdir()) == [f"round-{rounds}"]
    data = json.loads((run_dir / "dcp" / f"round-{rounds}" / "data-rank0.json").read_text())
    assert data["data"]["batches"] == before["steps"] + new_steps  # rank 0's stream went on from its position


def test_lora_with_fsdp_sends_only_adapter_rows_and_shards_the_frozen_base(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    recipe = load_config("recipe:hf-llama-tiny-lora")  # the shipped recipe's model, at test length
    cfg = tiny_config(model=recipe.model.model_dump(), rounds=2, train={"sync_every": 3, "lr": 1e-2})
    run_dir = tmp_path / "group"
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        adapters = set(c.service.inspect().weights)
        summaries = rank_summaries(finished(fsdp_cli_group(c.url, "group", run_dir)))
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
        status = c.service.status()
        assert c.service.finished
    assert adapters and all("lora_" in n for n in adapters)  # the coordinator holds the adapters alone
    assert status["model_bytes"] == sum(t.numel() * t.element_size() for t in final.values())
    for s in summaries:  # the frozen base is sharded too: each rank holds a part, together all of it, once
        assert s["param_bytes"] < s["model_param_bytes"], s
    assert sum(s["param_bytes"] for s in summaries) == summaries[0]["model_param_bytes"]
    assert summaries[0]["model_param_bytes"] > 10 * status["model_bytes"]
    for k in (0, 1):  # what each rank synced: adapter rows only, equal to the global adapters' rows
        mine = rows_of(run_dir / f"final-rank{k}.safetensors")
        assert set(mine) <= adapters
        for n, (t, (start, stop)) in mine.items():
            assert torch.equal(t, final[n][start:stop]) and stop - start < final[n].shape[0], (k, n)


def test_fsdp_outside_torchrun_is_one_clear_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "WORLD_SIZE", "RANK")}
    p = zygote.run([sys.executable, "-m", "fedtrain", "participant", "--parallel", "fsdp", "--coordinator",
                    "http://127.0.0.1:9", "--data", "stdlib:0/2", "--token", PTOKEN], env=env, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert "fedtrain participant: error: `--parallel fsdp` runs under torchrun: torchrun --nproc_per_node N" in p.stderr
