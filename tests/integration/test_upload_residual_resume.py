"""A participant's upload error feedback across a restart (#32): the residual (what topk
uploads have not sent yet) is saved with its local checkpoint at each round boundary and
given back when it joins again, so a participant that left and came back sends, over the
next rounds, the same total signal as one that never left: the run ends on the same global
model, bit for bit. A restart that finds no residual starts it from zero and says so."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.participant import Participant
from fedtrain.recipes import TokenStream
from fedtrain.recipes.runtime import RunDir
from tests.helpers.config import tiny_config
from tests.helpers.tiny import Regression, Small, TinyParticipant, init_file

H, ROUNDS = 3, 4
TRAIN = {"sync_every": H, "compression": "topk", "topk_density": 0.05, "topk_chunk": 64, "topk_bits": 2}
WIDE = functools.partial(Small, width=64)


def _task() -> Regression:
    return Regression(rows=16, seed=3, model=WIDE, lr=0.01)


def _saver(run_dir: RunDir, who: list[TinyParticipant]) -> Callable[[Participant, float], None]:
    """on_step: at each round boundary, the participant's checkpoint as the recipe writes it
    (`RunDir.after_sync`: its inner optimizer, a data position, its upload residual)."""
    seen = {"round": -1}
    stream = TokenStream(torch.arange(64), batch_size=1, seq_len=4, seed=0)  # (a position to keep)

    def save(fed: Participant, _loss: float) -> None:
        if fed.round != seen["round"]:
            seen["round"] = fed.round
            run_dir.after_sync(fed, who[0].optimizer, stream)
    return save


def _run(tmp_path: Path, *, leave_after: int | None, restore: bool = True) -> dict[str, torch.Tensor]:
    """The global model at the run's end: one participant, which (`leave_after` rounds in)
    leaves and joins again under its name, restoring its checkpoint (`restore`) or not."""
    cfg = tiny_config(rounds=ROUNDS, min_participants=1, outer={"algorithm": "fedavg"}, train=TRAIN)
    run_dir = RunDir(tmp_path / "p")
    torch.manual_seed(0)  # the same initial model in every run
    init = init_file(tmp_path, WIDE())
    with BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init) as c:
        steps = None if leave_after is None else leave_after * H
        who: list[TinyParticipant] = []
        first = TinyParticipant(c.url, "p", _task(), steps=steps, on_step=_saver(run_dir, who))
        who.append(first)
        first.run()
        assert first.fed is not None
        if leave_after is not None:
            assert first.fed.round == leave_after and first.fed.upload_residual()  # topk 5%: most of Δ is left

            def resume(fed: Participant) -> None:
                saved = run_dir.checkpoint.load(second.optimizer)
                assert saved is not None and saved["round"] == leave_after
                if restore:
                    run_dir.restore_counters(fed, saved)
                    kept = first.fed.upload_residual() if first.fed is not None else {}
                    back = fed.upload_residual()
                    assert set(back) == set(kept) and all(torch.equal(back[n], kept[n]) for n in kept)

            second = TinyParticipant(c.url, "p", _task(), on_join=resume, on_step=_saver(run_dir, who))
            who[0] = second
            second.run()
        assert c.service.status()["finished"]
        return {n: t.clone() for n, t in c.service.inspect().weights.items()}


def test_a_participant_that_left_and_came_back_sends_the_same_total_signal(tmp_path: Path) -> None:
    never_left = _run(tmp_path / "a", leave_after=None)
    came_back = _run(tmp_path / "b", leave_after=2)
    assert all(torch.equal(came_back[n], never_left[n]) for n in never_left)
    lost = _run(tmp_path / "c", leave_after=2, restore=False)  # without its residual: the signal it held is lost
    assert not all(torch.equal(lost[n], never_left[n]) for n in never_left)


def test_a_restart_without_a_saved_residual_starts_from_zero_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = tiny_config(rounds=1, min_participants=1, outer={"algorithm": "fedavg"}, train=TRAIN)
    run_dir = RunDir(tmp_path / "p")
    run_dir.checkpoint.save(round_=0, optimizer=None)  # a checkpoint with no residual (an older version's)
    saved = run_dir.checkpoint.load(None)
    assert saved is not None

    def resume(fed: Participant) -> None:
        run_dir.restore_counters(fed, saved)
        assert fed.upload_residual() == {}

    with caplog.at_level(logging.INFO, logger="fedtrain.recipe"), \
            BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init_file(tmp_path, WIDE())) as c:
        TinyParticipant(c.url, "p", _task(), steps=1, on_join=resume).run()
    assert any("upload error feedback starts from zero" in r.message for r in caplog.records)
