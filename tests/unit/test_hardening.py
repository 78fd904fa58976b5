"""Hardening (issue #18, items 10, 12, 13): deeply nested headers are a WireError, every
checkpoint file is verified on load, and every number of a run config is finite and in range."""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path

import pytest
import torch

from fedtrain.config import MIN_UPLOAD_MB, RunConfig, check_upload_limit, load_config, parse_config
from fedtrain.config.changes import apply_change
from fedtrain.coordinator.members.auth import Tokens
from fedtrain.coordinator.model.checkpoints import STATE_DIGEST_KEY, CheckpointDir
from fedtrain.errors import ConfigError, StateError, WireError
from fedtrain.merge import OuterOptimizer
from fedtrain.wire import BodyReader, parse_header, write_file
from fedtrain.wire.format import MAX_HEADER_DEPTH

# -- item 10: nesting in a safetensors header -----------------------------------------------------

ENTRY = b'"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'


def nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


@pytest.mark.parametrize(
    "raw",
    [
        b'{"__metadata__": ' + nested(100_000) + b"}",  # a RecursionError before the fix
        b'{"__metadata__": ' + nested(2_000, b'{"a":', b"}") + b"}",
        b"[" * 100_000,  # never closed: the parser recursed just the same
        b"{" + ENTRY + b', "y": ' + nested(MAX_HEADER_DEPTH) + b"}",  # one level too many, small
    ],
    ids=["arrays", "objects", "unclosed", "just_too_deep"],
)
def test_a_deeply_nested_header_is_a_wire_error(raw: bytes) -> None:
    with pytest.raises(WireError, match="nests arrays or objects more than"):
        parse_header(raw)


def test_nesting_within_the_limit_is_left_to_the_other_checks() -> None:
    # depth MAX_HEADER_DEPTH (the header object and 7 lists) is not refused for its nesting
    with pytest.raises(WireError, match="__metadata__"):
        parse_header(b'{"__metadata__": ' + nested(MAX_HEADER_DEPTH - 1) + b"}")
    # brackets inside strings (names, escaped quotes) are text, not nesting
    name = "layers[[[[[[[[[[[[[[[[[[\\\"{{{{{{{{{{{{{{.w"
    raw = json.dumps({name.replace('\\"', '"'): {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    [spec], _ = parse_header(raw)
    assert spec.name.startswith("layers[[[")


def test_a_streamed_body_with_a_deep_header_is_refused() -> None:
    header = b'{"__metadata__": ' + nested(50_000) + b"}"
    reader = BodyReader()
    with pytest.raises(WireError, match="nests"):
        reader.feed(struct.pack("<Q", len(header)) + header)


# -- item 12: every checkpoint file verified on load ----------------------------------------------


def _outer_state(n: int = 64) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
    params = {"w": torch.randn(n), "b": torch.randn(3)}
    outer = OuterOptimizer(params, "diloco", {"lr": 0.7, "momentum": 0.9, "nesterov": True})
    outer.step({k: torch.randn_like(v) for k, v in params.items()})  # momentum buffers exist now
    return outer.params, outer.state_tensors(), outer.state_metadata()


def _write(ckpt: CheckpointDir, version: int) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    params, state, meta = _outer_state()
    digest = ckpt.write(version, params, state, meta, {"run": "t"}).digest
    return digest, state, meta


def _data_start(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _flip(path: Path, at: int, mask: int = 0x40) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(bytes(data))


def test_outer_state_round_trips_verified(tmp_path: Path) -> None:
    ckpt = CheckpointDir(tmp_path)
    digest, state, meta = _write(ckpt, 2)
    tensors, got_meta = ckpt.load_outer(2)
    assert got_meta == meta  # the digest key is the file's, not the optimizer's
    for name, t in state.items():
        assert torch.equal(tensors[name], t)
    OuterOptimizer.restore(ckpt.load_global(2, digest), tensors, got_meta)
    assert ckpt.unverified() == []


def test_a_flipped_byte_in_the_outer_state_data_is_damage_on_disk(tmp_path: Path) -> None:
    ckpt = CheckpointDir(tmp_path)
    _write(ckpt, 2)
    path = ckpt.outer_path(2)
    _flip(path, _data_start(path) + 5)  # inside the first tensor: still a finite float
    with pytest.raises(StateError) as info:
        ckpt.load_outer(2)
    message = info.value.message
    assert "outer-000002.safetensors is damaged on disk" in message
    assert "does not match the digest" in message and "transit" not in message


def test_a_flipped_byte_in_the_outer_state_header_is_found(tmp_path: Path) -> None:
    ckpt = CheckpointDir(tmp_path)
    _write(ckpt, 2)
    path = ckpt.outer_path(2)
    raw = path.read_bytes()
    at = raw.index(b'"steps":"1"') + len(b'"steps":"')  # the step count: "1" becomes "2", still valid
    _flip(path, at, 0x03)
    with pytest.raises(StateError, match="outer-000002.safetensors is damaged on disk"):
        ckpt.load_outer(2)


def test_a_flipped_byte_in_the_model_file_is_damage_on_disk_too(tmp_path: Path) -> None:
    ckpt = CheckpointDir(tmp_path)
    digest, _, _ = _write(ckpt, 2)
    path = ckpt.global_path(2)
    _flip(path, _data_start(path) + 1)
    with pytest.raises(StateError) as info:
        ckpt.load_global(2, digest)
    assert "global-000002.safetensors is damaged on disk" in info.value.message
    assert "transit" not in info.value.message


def test_an_outer_file_without_a_digest_still_loads_and_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Files written before the digest existed: loaded, logged, listed as unverified."""
    ckpt = CheckpointDir(tmp_path)
    _, state, meta = _outer_state()
    write_file(ckpt.outer_path(1), state, meta)  # the old layout: no STATE_DIGEST_KEY
    assert STATE_DIGEST_KEY not in ckpt.outer_path(1).read_bytes().decode("latin-1")
    with caplog.at_level(logging.WARNING, logger="fedtrain.coordinator.model.checkpoints"):
        tensors, got_meta = ckpt.load_outer(1)
    assert got_meta == meta and torch.equal(tensors["momentum_buffer/w"], state["momentum_buffer/w"])
    assert ckpt.unverified() == ["outer-000001.safetensors"]
    assert "outer-000001.safetensors carries no digest" in caplog.text

    # what it can still catch without a digest: values that would make the next model non-finite
    write_file(ckpt.outer_path(3), {**state, "momentum_buffer/w": torch.full((4,), math.inf)}, meta)
    with pytest.raises(StateError, match="outer-000003.safetensors is damaged on disk.*non-finite"):
        ckpt.load_outer(3)


# -- item 13: finite, workable numbers in a run config -------------------------------------------


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"round_timeout_s": math.inf}, "round_timeout_s"),
        ({"round_timeout_s": math.nan}, "round_timeout_s"),
        ({"outer": {"lr": math.inf}}, "outer.lr"),
        ({"train": {"lr": math.nan}}, "train.lr"),
        ({"outer": {"clip_norm": math.inf}}, "outer.clip_norm"),
        ({"heartbeat_timeout_s": math.inf}, "heartbeat_timeout_s"),
        ({"max_upload_mb": math.inf}, "max_upload_mb"),
        ({"max_upload_mb": 1e-9}, "max_upload_mb"),
        ({"max_upload_mb": 0}, "max_upload_mb"),
        ({"round_timeout_s": 1e300}, "round_timeout_s"),
        ({"heartbeat_interval_s": 1e-9}, "heartbeat_interval_s"),
        ({"outer": {"lr": 1e6}}, "outer.lr"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_a_number_that_cannot_work_is_refused_with_its_field(patch: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"config: {field}: "):
        parse_config(patch)
    with pytest.raises(ConfigError, match=rf"config change: {field}: "):
        apply_change(RunConfig(), patch)


def test_infinity_in_a_config_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("round_timeout_s: .inf\nouter:\n  lr: .inf\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in info.value.message
    assert "round_timeout_s: Input should be a finite number" in info.value.message
    assert "outer.lr: Input should be a finite number" in info.value.message
    path = tmp_path / "run.json"
    path.write_text('{"max_upload_mb": 1e-9, "outer": {"lr": Infinity}}')
    with pytest.raises(ConfigError, match="max_upload_mb: Input should be greater than or equal to 0.01"):
        load_config(path)


def test_a_non_finite_number_inside_a_transformers_config_is_refused() -> None:
    hf = {"config": {"model_type": "gpt2", "layer_norm_epsilon": math.inf}}
    with pytest.raises(ConfigError, match=r"model.hf.config.layer_norm_epsilon is not a finite number"):
        parse_config({"model": {"recipe": "hf", "hf": hf}})


def test_the_upload_limit_must_hold_one_update_of_the_model() -> None:
    cfg = parse_config({"max_upload_mb": 1.0})
    check_upload_limit(cfg, 1_000_000)  # exactly one update fits
    with pytest.raises(ConfigError) as info:
        check_upload_limit(cfg, 1_000_001)
    message = info.value.message
    assert "max_upload_mb" in message and "1,000,001 bytes" in message and "at least 1.01" in message

    # the live-change seam: the coordinator passes the size of one update under the new config
    sizes = {"none": 4_000_000, "int8": 1_100_000}
    size = lambda c: sizes[c.train.compression]  # noqa: E731
    apply_change(cfg, {"max_upload_mb": 4.0}, update_bytes=size)
    apply_change(cfg, {"max_upload_mb": 2.0, "train": {"compression": "int8"}}, update_bytes=size)
    with pytest.raises(ConfigError, match="config change: max_upload_mb: 2 MB"):
        apply_change(cfg, {"max_upload_mb": 2.0}, update_bytes=size)
    assert MIN_UPLOAD_MB > 0


# -- item 14: one refusal for a token, however it arrives -----------------------------------------


def test_refusal_names_a_revoked_token() -> None:
    from fedtrain.coordinator.members.auth import fingerprint

    tokens = Tokens(["tok-a"], "admin", revoked={fingerprint("tok-a")})
    assert tokens.identify("Bearer tok-a") is None
    assert tokens.refusal("Bearer tok-a")[0] == "token_revoked"
    assert tokens.refusal("Bearer nope") == ("unauthorized", "invalid token: not a token of this run")
    assert tokens.refusal(None) == ("unauthorized", "missing bearer token")
    assert tokens.refusal("Basic tok-a")[0] == "unauthorized"  # not a bearer token at all
