"""Whole runs over loopback that several test modules share: the recipe's GPT per participant,
participants trained to the end and checked against the global model, the held-out loss,
Streaming DiLoCo's fragments of `Small`, a tiny Llama with LoRA trained by two recipe threads."""

from __future__ import annotations

from pathlib import Path

import torch

from fedtrain.recipes import build_model
from fedtrain.recipes.data import TokenStream, evaluate, heldout_paths, load_tokens
from fedtrain.recipes.train import run_participant
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.tiny import (
    Small,
    TinyGPT,
    TinyParticipant,
    TrainingThread,
    join_all,
    run_all,
)


def recipe_gpt(i: int, n: int) -> TinyGPT:
    """Participant i of n: the recipe's GPT (seed 123 + i) on its shard of the stdlib text, with
    the run's batch size, sequence length and learning rate."""
    return TinyGPT(shard=i, of=n, model_seed=123 + i)


def train_all(url: str, n: int) -> dict[int, dict[str, torch.Tensor]]:
    """n participants training in threads until the run finishes; their final weights."""
    runners = run_all([TinyParticipant(url, f"p{i}", recipe_gpt(i, n)) for i in range(n)])
    return {i: p.weights for i, p in enumerate(runners)}


def assert_all_on(results: dict, final_global: dict[str, torch.Tensor]) -> None:
    """Every participant ends on the global weights, bit for bit."""
    for i, weights in results.items():
        for name, t in final_global.items():
            assert torch.equal(weights[name], t), (i, name)


def heldout_loss(params: dict[str, torch.Tensor]) -> float:
    cfg = tiny_config()
    model = build_model(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    stream = TokenStream(load_tokens(heldout_paths()), batch_size=8, seq_len=32, seed=0, heldout_fraction=0.5)
    return evaluate(model, stream.eval_batches(8))


FRAGMENTS = [["lin.*"], ["head.*"]]  # `Small`: its two layers


def initial_model() -> Small:
    torch.manual_seed(0)
    return Small()


LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "vocab_size": 256,
}


def run_two(url: str, tmp: Path) -> dict[int, dict]:
    """Two recipe participants in threads until the run finishes; their summaries."""
    threads = [TrainingThread(run_participant, url, PTOKEN, f"stdlib:{i}/2", name=f"p{i}", run_dir=tmp / f"p{i}")
               for i in range(2)]
    join_all(*(t.start() for t in threads), timeout=180)
    return {i: t.result for i, t in enumerate(threads)}
