"""Streaming DiLoCo with an FSDP2 participant (2 ranks, gloo, CPU, torchrun): K = 2, τ = 0 and 1, α = 0.3.

Each round every rank uploads its rows of the round's fragment only, as its piece, downloads
its rows of that fragment only, and mixes them into its shard; the run ends on the global
weights of a single-process participant that streams the same config on the same global
batches (its own coordinator). The inner optimizer is SGD, linear in the gradients, so the
two sides differ only by float rounding (see test_fsdp_numerics.py): 1e-5. A coordinator that
fails some of a fragment round's pieces is ridden out by the group as a whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedtrain.config import RunConfig
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.streaming import fragments
from tests.helpers.config import tiny_config
from tests.helpers.fsdp import MODEL, fail_round_one_pieces, max_diff, one_thread, params, run_single, shards_match
from tests.helpers.processes import kill_tree
from tests.helpers.torchrun import worker_group

ROUNDS, H, K, SEED = 4, 4, 2, 21  # S = H/K = 2 steps a round, each fragment synced twice


def streaming_config(tau: int) -> RunConfig:
    """The outer lr is torchft's 0.7, as in the other streaming tests."""
    return tiny_config(rounds=ROUNDS, model=MODEL, train={"sync_every": H}, outer={"lr": 0.7},
                       streaming={"fragments": K, "overlap": tau, "alpha": 0.3})


@pytest.mark.parametrize("tau", [0, 1])
def test_an_fsdp_group_streams_each_fragment_by_rows_and_ends_on_the_single_process_weights(tmp_path: Path,
                                                                                            tau: int) -> None:
    """τ = 1: each rank sends its rows of the fragment one step before the round's end and trains
    on meanwhile, as the single process does."""
    cfg = streaming_config(tau)
    with one_thread(), BackgroundCoordinator(tmp_path / "g", cfg) as g, BackgroundCoordinator(tmp_path / "s", cfg) as s:
        theta0 = params(g)
        group = worker_group("fsdp_numerics_worker.py", str(tmp_path), f"{g.url},group,{SEED},sgd")
        try:
            run_single(s.url, "single", SEED, 2 * cfg.train.batch_size, "sgd", cfg)  # the group's global batches
            out, _ = group.communicate(timeout=180)
        finally:
            kill_tree(group)
        assert group.returncode == 0, out[-3000:]
        assert g.service.finished and s.service.finished and g.service.version == ROUNDS
        final_g, final_s = params(g), params(s)
        moved = [r["fragment"] for r in sorted(g.service.status()["recent_rounds"], key=lambda r: r["round"])]
    assert moved == [r % K for r in range(ROUNDS)]
    reports = [json.loads((tmp_path / f"group-rank{k}.json").read_text()) for k in (0, 1)]
    plan = fragments(list(theta0), K)  # the coordinator's: strided by block
    size = [sum(theta0[n].numel() * theta0[n].element_size() for n in names) for names in plan]
    for k, report in enumerate(reports):
        history = report["history"]
        assert [h["fragment"] for h in history] == [r % K for r in range(ROUNDS)]
        assert [h["piece"]["piece"] for h in history] == [f"rank{k}"] * ROUNDS
        assert all(h["steps"] == H // K for h in history)
        # the ranks together downloaded exactly the round's fragment (and, at the end, the others)
        assert [h["bytes_down"] for h in history[:-1]] == [size[r % K] for r in range(ROUNDS - 1)]
        assert history[-1]["bytes_down"] == sum(size)
        assert all(h["bytes_up"] < sum(size) for h in history)  # a fragment's rows, never the whole sync set
    assert sum(h["piece"]["complete"] for rep in reports for h in rep["history"]) == ROUNDS
    assert max_diff(final_s, theta0)[0] > 1e-3  # the run moved the weights: no comparison of starts
    diff, where = max_diff(final_g, final_s)
    print(f"max |θ_fsdp − θ_single| = {diff:.3g} in {where}; moved up to {max_diff(final_s, theta0)[0]:.3g}")
    assert diff <= 1e-5, f"max |θ_fsdp − θ_single| = {diff:.3g} in {where}"


def test_a_streaming_fsdp_group_rides_out_a_coordinator_that_fails_one_of_its_fragment_pieces(tmp_path: Path) -> None:
    """int8 deltas with error feedback, per fragment and per rank; round 1's first piece gets in
    and the group's other uploads fail for a while: every rank puts its fragment's reference back
    and the group sends round 1's fragment again, whole, once the coordinator takes it."""
    cfg = tiny_config(rounds=ROUNDS, model={"n_layer": 2}, train={"sync_every": H, "compression": "int8",
                                                                "error_feedback": True},
                      streaming={"fragments": K, "overlap": 0, "alpha": 0.5})
    out = tmp_path / "fsdp"
    out.mkdir()
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        service = c.service
        fail_round_one_pieces(c, out, hold_s=3)
        final = {k: v.clone() for k, v in service.inspect().weights.items()}
        assert service.finished and service.version == ROUNDS
    reports = [json.loads((out / f"rank{k}.json").read_text()) for k in (0, 1)]
    assert reports[0]["outages"] and reports[0]["outages"][0]["round"] == 1, reports[0]["outages"]
    assert [h["fragment"] for h in reports[0]["history"]] == [r % K for r in range(ROUNDS)]
    shards_match(out, final)  # the run's end: every rank's rows are the global model's
    assert all(torch.isfinite(t).all() for t in final.values())
