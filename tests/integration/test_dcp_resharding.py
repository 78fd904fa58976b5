"""A DcpCheckpoint reshards: written on 1 rank it loads on 2 (each rank its rows, a rank with no
saved data position gets an empty user state), and written on 2 it loads on 1 (every row, put
together from both ranks' files), with every optimizer tensor equal to the one saved."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fedtrain.participant.local.dcp_checkpoint import DcpCheckpoint
from fedtrain.participant.ranks.shards import chunk_rows
from tests.helpers.dcp import gloo_of_one, optimizer_tensors, sharded, train
from tests.helpers.torchrun import finished, worker_group


def test_a_checkpoint_reshards_from_one_rank_to_two_and_back(tmp_path: Path) -> None:
    one, two = tmp_path / "one-rank", tmp_path / "two-ranks"
    with gloo_of_one():
        model, opt = sharded()
        train(model, opt, 3)
        DcpCheckpoint(one, model).save(round_=3, optimizer=opt, steps=3, user_state={"rank": 0})
        save_file({n: t.contiguous() for n, t in optimizer_tensors(model, opt).items()}, f"{one}-ref.safetensors")

    finished(worker_group("dcp_worker.py", str(one), str(two)), timeout=180)
    reports = [json.loads((tmp_path / f"loaded-rank{k}.json").read_text()) for k in (0, 1)]
    for report in reports:  # 1 -> 2: each rank's rows of every saved tensor
        assert report["wrong"] == [] and report["checked"] > 0, report
        assert report["record"]["round"] == 3 and report["record"]["world_size"] == 1
    assert reports[0]["record"]["user_state"] == {"rank": 0}
    assert reports[1]["record"]["user_state"] == {}  # the 1-rank world had no rank 1: its stream starts fresh

    parts = [load_file(f"{two}-ref-rank{k}.safetensors") for k in (0, 1)]
    with gloo_of_one():  # 2 -> 1: the one rank holds every row, put together from both ranks' files
        model, opt = sharded()
        record = DcpCheckpoint(two, model).load(opt)
        got = optimizer_tensors(model, opt)
    assert record is not None and record["world_size"] == 2 and record["user_state"] == {"rank": 0}
    assert got.keys() == parts[0].keys()
    for name, t in got.items():
        if t.dim() == 0:  # AdamW's step: the same on both ranks
            assert torch.equal(t, parts[0][name]) and torch.equal(t, parts[1][name]), name
            continue
        for k in (0, 1):
            start, stop = chunk_rows(t.shape[0], 2, k)
            assert torch.equal(t[start:stop], parts[k][name]), (name, k)
    assert float(got["wte.weight/step"]) == 5  # 3 steps on one rank, 2 more on two
