"""Two ranks (gloo) check the participant's control channel (`participant/ranks/control.py`): it is
a group of its own beside the training group, and its collectives agree."""

from __future__ import annotations

import torch.distributed as dist

from fedtrain.participant.ranks.control import RankGroup
from tests.helpers.workers import end_at_once


def one_life() -> None:
    dist.init_process_group("gloo")
    ranks = RankGroup()
    assert ranks.world_size == 2 and not ranks.solo and ranks.control is not dist.group.WORLD
    assert ranks.broadcast_json({"from": ranks.rank}) == {"from": 0}
    assert ranks.gather_json(ranks.rank) == [0, 1]
    assert ranks.sum([ranks.rank + 1]) == [3.0]
    assert ranks.all_true(ranks.rank == 0) is False and ranks.rank0_says(ranks.rank == 0) is True
    outcomes, error = ranks.together(lambda: ranks.rank * 10)
    assert error is None and [o.result for o in outcomes] == [0, 10]
    ranks.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    one_life()
    print("control ok")
    end_at_once()
