"""Streaming DiLoCo over loopback (config `streaming`): real coordinators and participants.

- Two participants streaming K = 2 fragments with τ = 1 and α = 0.5 end on the global and
  local weights of `fedtrain.streaming.simulate` (torchft's semantics, checked against
  torchft itself in tests/slow/test_streaming_torchft.py), to 1e-5 (α = 0.3); each participant
  synced the fragments round robin, and ends on the global model.
- K = 1, τ = 0, α = 0 runs the streaming code paths and is plain DiLoCo, bit for bit.
- int8 deltas with error feedback per fragment: the run trains, every upload is one fragment.
- A coordinator killed mid-cycle (after committing round 2 of K = 2) resumes with every
  committed round, none repeated, and the participants finish on the global model.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import CoordinatorClient, OutagePolicy
from fedtrain.streaming import simulate
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.fsdp import fsdp_cli_group
from tests.helpers.processes import free_port, start_coordinator, stop_coordinator
from tests.helpers.runs import FRAGMENTS, LLAMA, initial_model, run_two
from tests.helpers.streaming import Fixed, streaming_config
from tests.helpers.tiny import Small, TinyParticipant, init_file, join_all, run_all
from tests.helpers.torchrun import finish, participant, participant_group, weights


def reference(tasks: list[Fixed], *, steps: int, h: int, tau: int, alpha: float) -> Any:
    """What torchft's streaming DiLoCo makes of the same start, batches and inner optimizer."""
    batches = [t.build().batch() for t in tasks]
    start = initial_model().state_dict()

    def build() -> Small:
        m = Small()
        m.load_state_dict(start)
        return m

    names = [[n for n in start if n.startswith(p[0][:-1])] for p in FRAGMENTS]
    return simulate(build, lambda r, t: batches[r], lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                    lambda ps: torch.optim.SGD(ps, lr=tasks[0].lr), replicas=len(tasks), steps=steps, h=h,
                    fragment_names=names, tau=tau, alpha=alpha)


def test_two_participants_streaming_match_torchfts_semantics(tmp_path: Path) -> None:
    rounds, h, tau, alpha = 8, 4, 1, 0.3  # K = 2: S = 2 steps a round, 16 steps each; α ≠ 0.5 tells the sides apart
    cfg = streaming_config(rounds, h, {"fragments": 2, "assign": FRAGMENTS, "overlap": tau, "alpha": alpha})
    tasks = [Fixed(rows=16, seed=10 + i) for i in range(2)]
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, initial_model())) as c:
        runners = run_all([TinyParticipant(c.url, f"p{i}", task) for i, task in enumerate(tasks)])
        with CoordinatorClient(c.url, PTOKEN) as cl:
            status = cl.status()
            version, final = cl.download()
    assert status["finished"] and version == rounds
    ref = reference(tasks, steps=rounds * h // 2, h=h, tau=tau, alpha=alpha)
    for name, want in ref.global_weights.items():
        torch.testing.assert_close(final[name], want, rtol=0, atol=1e-5, msg=name)
    for runner in runners:
        assert runner.fed is not None
        assert [rec["fragment"] for rec in runner.fed.history] == [r % 2 for r in range(rounds)]
        assert all(rec["steps"] == 2 for rec in runner.fed.history)
        for name, t in final.items():  # the run is over: every fragment is the global one (torchft keeps local)
            assert torch.equal(runner.weights[name], t), (runner.name, name)
    assert sorted(r["fragment"] for r in status["recent_rounds"]) == sorted(r % 2 for r in range(rounds))


def run_and_collect(tmp_path: Path, cfg: Any, tasks: list[Fixed]) -> tuple[dict, list[dict], list[int]]:
    tmp_path.mkdir()
    with BackgroundCoordinator(tmp_path, cfg, init_weights=init_file(tmp_path, initial_model())) as c:
        runners = run_all([TinyParticipant(c.url, f"p{i}", task) for i, task in enumerate(tasks)])
        with CoordinatorClient(c.url, PTOKEN) as cl:
            _, final = cl.download()
    return final, [r.weights for r in runners], [r.fed.bytes_up for r in runners if r.fed is not None]


def test_one_fragment_without_overlap_or_mixing_is_plain_diloco_bit_for_bit(tmp_path: Path) -> None:
    tasks = [Fixed(rows=16, seed=20 + i) for i in range(2)]
    plain_cfg = tiny_config(rounds=4, train={"sync_every": 3}, min_participants=2, outer={"lr": 0.7})
    plain, plain_local, plain_up = run_and_collect(tmp_path / "plain", plain_cfg, tasks)
    one = streaming_config(4, 3, {"fragments": 1, "assign": [["*"]], "overlap": 0, "alpha": 0.0})
    streamed, streamed_local, streamed_up = run_and_collect(tmp_path / "streamed", one, tasks)
    for name, t in plain.items():
        assert torch.equal(streamed[name], t), name
    for a, b in zip(plain_local, streamed_local, strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert plain_up == streamed_up  # the same bytes went up: the whole sync set each round


def test_int8_deltas_with_error_feedback_per_fragment(tmp_path: Path) -> None:
    cfg = streaming_config(6, 4, {"fragments": 2, "assign": FRAGMENTS, "overlap": 1, "alpha": 0.5},
                           train={"compression": "int8", "error_feedback": True, "compression_block": 8})
    tasks = [Fixed(rows=16, seed=30 + i) for i in range(2)]
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, initial_model())) as c:
        start_loss = [t.build().loss(initial_model(), t.build().batch()).item() for t in tasks]
        runners = run_all([TinyParticipant(c.url, f"p{i}", task) for i, task in enumerate(tasks)])
    for r, before in zip(runners, start_loss, strict=True):
        assert r.fed is not None and r.fed.round == 6 and r.losses[-1] < before
        fragments = [rec["fragment"] for rec in r.fed.history]
        assert fragments == [0, 1, 0, 1, 0, 1]
        up = [rec["bytes_up"] for rec in r.fed.history]
        assert up[0] != up[1]  # one fragment each: `lin` (3x4 + 4) and `head` (4 + 1) differ in size


def test_a_coordinator_killed_mid_cycle_resumes_with_every_committed_round(tmp_path: Path) -> None:
    rounds = 10
    cfg = streaming_config(rounds, 4, {"fragments": 2, "assign": FRAGMENTS, "overlap": 1, "alpha": 0.5})
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(cfg.model_dump_json())
    state, log, port = tmp_path / "state", tmp_path / "coordinator.log", free_port()
    url = f"http://127.0.0.1:{port}"
    init = init_file(tmp_path, initial_model())
    # killed right after the database commit of round 2 (fragment 0), before round 3 (fragment 1) opens
    proc = start_coordinator(cfg_path, state, port, log, "--init-weights", str(init),
                             env={"FEDTRAIN_FAULTS": "commit.after_db:kill:round=2"})
    runners = [TinyParticipant(url, f"p{i}", Fixed(rows=16, seed=40 + i), step_sleep_s=0.01,
                               outage=OutagePolicy(budget_s=120.0, attempt_s=5.0, backoff_max_s=1.0))
               for i in range(2)]
    try:
        for r in runners:
            r.start()
        assert proc.wait(timeout=120) == -signal.SIGKILL, log.read_text()[-3000:]
        time.sleep(0.5)
        proc = start_coordinator(cfg_path, state, port, log, "--init-weights", str(init))
        join_all(*runners)
        with CoordinatorClient(url, PTOKEN) as cl:
            status = cl.status()
            version, final = cl.download()
    finally:
        stop_coordinator(proc)
    assert status["finished"] and version == rounds
    committed = sorted((r["round"], r["fragment"]) for r in status["recent_rounds"])
    assert committed == [(r, r % 2) for r in range(rounds)], committed  # none lost or repeated, the right fragments
    for r in runners:
        assert r.fed is not None and r.fed.round == rounds
        fragments = [(rec["round"], rec["fragment"]) for rec in r.fed.history]
        assert all(f == rnd % 2 for rnd, f in fragments), fragments
        assert all(torch.isfinite(t).all() for t in final.values())


def test_a_torchrun_group_streams_beside_a_single_process(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=4, min_participants=2, model={"n_layer": 2}, train={"sync_every": 4},
                      streaming={"fragments": 2, "overlap": 1, "alpha": 0.5})  # strided: one block each
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        group = participant_group(c.url, "group", "--run-dir", str(tmp_path / "group"))
        finish(group, participant(c.url, "single", "--run-dir", str(tmp_path / "single")))
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
        rounds = c.service.round_history()
        assert c.service.finished and c.service.version == 4
    assert [r["fragment"] for r in sorted(rounds, key=lambda r: r["round"])] == [0, 1, 0, 1]
    for r in rounds:  # both took part in every round, each with the round's fragment only
        assert {s["participant_id"] for s in r["submissions"]} == {"group", "single"}
        assert len({s["bytes"] for s in r["submissions"]}) == 1
    files = [tmp_path / "group" / "final.safetensors", tmp_path / "group" / "final-rank1.safetensors",
             tmp_path / "single" / "final.safetensors"]
    for f in files:  # both ranks and the single process end on the global weights
        w = weights(f)
        assert w.keys() == final.keys() and all(torch.equal(w[k], final[k]) for k in final), f


def test_lora_streams_its_adapters_a_fragment_at_a_time(tmp_path: Path) -> None:
    from fedtrain.recipes import build_model
    from fedtrain.streaming import fragments
    from fedtrain.wire import EncodedBody

    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    cfg = tiny_config(model={"recipe": "hf", "hf": {"config": LLAMA}, "lora": lora}, rounds=4, min_participants=2,
                      train={"sync_every": 4, "lr": 1e-2}, streaming={"fragments": 2, "overlap": 1, "alpha": 0.5})
    model = build_model(cfg.model, seed=cfg.seed)
    adapters = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    plan = fragments(list(adapters), 2)  # layers.0's adapters, then layers.1's
    body = [EncodedBody({n: adapters[n] for n in names}).content_length for names in plan]
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        results = run_two(c.url, tmp_path)
        rounds = sorted(c.service.round_history(), key=lambda r: r["round"])
        assert c.service.finished
    assert all(r["rounds"] == 4 for r in results.values())
    assert all(len(names) > 0 and all(".layers." in n for n in names) for names in plan)
    for r in rounds:  # every upload is the round's fragment of the adapters, no more
        assert [s["bytes"] for s in r["submissions"]] == [body[r["round"] % 2]] * 2, r["submissions"]


def test_in_the_overlapped_mode_a_fast_site_trains_on_until_its_fragment_arrives(tmp_path: Path) -> None:
    cfg = streaming_config(6, 4, {"fragments": 2, "assign": FRAGMENTS, "overlap": 1, "alpha": 0.5},
                           train={"overlap": True})
    tasks = [Fixed(rows=16, seed=50 + i) for i in range(2)]
    with BackgroundCoordinator(tmp_path / "s", cfg, init_weights=init_file(tmp_path, initial_model())) as c:
        fast, slow = run_all([TinyParticipant(c.url, "fast", tasks[0]),
                              TinyParticipant(c.url, "slow", tasks[1], step_sleep_s=0.05)])
        with CoordinatorClient(c.url, PTOKEN) as cl:
            version, final = cl.download()
    assert version == 6
    for r in (fast, slow):
        assert r.fed is not None and [rec["fragment"] for rec in r.fed.history] == [0, 1, 0, 1, 0, 1]
        assert all(rec["steps"] >= 2 for rec in r.fed.history)  # never applied before the round's H/K steps
        assert all(torch.equal(r.weights[n], t) for n, t in final.items())
    assert fast.fed is not None and max(rec["steps"] for rec in fast.fed.history) > 2  # it did not wait at H/K


def test_an_fsdp_group_streams_with_overlap_through_the_recipe(tmp_path: Path) -> None:
    """`fedtrain participant --parallel fsdp` on a run with τ = 1: each rank sends its rows of the
    round's fragment one step before the round's end and trains on meanwhile (the numerics of it
    are test_fsdp_streaming.py's); the run ends on every rank."""
    cfg = tiny_config(rounds=4, model={"n_layer": 2}, train={"sync_every": 4},
                      streaming={"fragments": 2, "overlap": 1})
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        group = fsdp_cli_group(c.url, "group", tmp_path / "group", via="fedtrain")
        out, _ = group.communicate(timeout=180)
        status = c.service.status()
    assert group.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert status["finished"] and status["current_round"] == 4, status
    moved = [r["fragment"] for r in sorted(status["recent_rounds"], key=lambda r: r["round"])]
    assert moved == [0, 1, 0, 1]
    summaries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert sorted(s["rank"] for s in summaries) == [0, 1] and all(s["rounds"] == 4 for s in summaries), out[-3000:]
