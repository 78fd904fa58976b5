"""The run configuration: the typed `RunConfig` and its sections (`run_config`,
`model_config`, `sections`, `privacy`), the bounds of its fields (`bounds`), live changes and
their diff (`changes`), and the generator of docs/config.md (`doc`). The names of the model are
re-exported here: `from fedtrain.config import RunConfig`."""

from __future__ import annotations

from fedtrain.config.bounds import (
    MAX_LR,
    MAX_SECONDS,
    MAX_UPDATE_TOKENS,
    MAX_UPLOAD_MB,
    MB,
    MIN_HEARTBEAT_S,
    MIN_UPLOAD_MB,
    SEED_RANGE,
)
from fedtrain.config.model_config import HFModelConfig, LoraConfig, ModelConfig
from fedtrain.config.privacy import PrivacyConfig
from fedtrain.config.run_config import (
    RECIPES_DIR,
    Algorithm,
    EvalConfig,
    OuterConfig,
    RunConfig,
    TrainConfig,
    check_upload_limit,
    load_config,
    outer_choice,
    outer_defaults,
    parse_config,
    recipe_path,
)
from fedtrain.config.sections import AsyncConfig, ScheduleConfig, StreamingConfig, TransferConfig

__all__ = [
    "MAX_LR",
    "MAX_SECONDS",
    "MAX_UPDATE_TOKENS",
    "MAX_UPLOAD_MB",
    "MB",
    "MIN_HEARTBEAT_S",
    "MIN_UPLOAD_MB",
    "RECIPES_DIR",
    "SEED_RANGE",
    "Algorithm",
    "AsyncConfig",
    "EvalConfig",
    "HFModelConfig",
    "LoraConfig",
    "ModelConfig",
    "OuterConfig",
    "PrivacyConfig",
    "RunConfig",
    "ScheduleConfig",
    "StreamingConfig",
    "TrainConfig",
    "TransferConfig",
    "check_upload_limit",
    "load_config",
    "outer_choice",
    "outer_defaults",
    "parse_config",
    "recipe_path",
]
