"""Outer-optimizer test pieces: hyperparameters per algorithm, a random model, and an outer
optimizer saved and restored through safetensors bytes."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load, save

from fedtrain.config import RunConfig, outer_defaults
from fedtrain.merge import (
    OuterOptimizer,
    TensorDict,
)


def hp_for(algorithm: str, **overrides: object) -> dict:
    if algorithm == "delayed_nesterov":  # asynchronous mode's step, with DiLoCo's lr and momentum
        algorithm = "diloco"
    pinned = {"lr": 0.7} if algorithm == "diloco" else {}  # the paper's lr, which the hand-computed steps use
    return outer_defaults(RunConfig.model_validate({"outer": {"algorithm": algorithm, **pinned, **overrides}}))


def random_model(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> TensorDict:
    shapes = {"embed.weight": (5, 3), "block.0.bias": (3,), "head.weight": (2, 3), "scale": ()}
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}


def header_metadata(data: bytes) -> dict[str, str]:
    """The __metadata__ of a safetensors body: u64 header length, then the JSON header."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size])["__metadata__"]


def roundtrip(outer: OuterOptimizer) -> OuterOptimizer:
    """Through safetensors bytes, as the coordinator checkpoints a committed round."""
    params = load(save(outer.params))
    state_bytes = save(outer.state_tensors(), metadata=outer.state_metadata())
    return OuterOptimizer.restore(params, load(state_bytes), header_metadata(state_bytes))
