"""Live changes to a run config: validated against the config in force, with their true diff.

A change is a merge patch (`{"train": {"sync_every": 30}}`) applied to the newest version;
the result must validate, leave the fields fixed for the run alone and (given the model's
update size) hold one upload. `config_diff` and `patch_of` turn configs into dotted diffs
and back (the SIGHUP merge uses both); `change_notes` says what a change implies in words.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedtrain.config.compression import download_notes
from fedtrain.config.privacy import FIXED_REASON as PRIVACY_FIXED
from fedtrain.config.run_config import RunConfig, check_upload_limit, outer_defaults, parse_config
from fedtrain.errors import ConfigError

#: Fields that define the run itself; a live change to any of them is refused.
FIXED_FIELDS: dict[str, str] = {
    "name": "the run's name identifies its state",
    "seed": "the seed made the initial weights",
    "model": "the model architecture (and so the sync set) is fixed for the life of a run",
    "streaming.fragments": "each fragment keeps its own outer optimizer state and reference weights, and the "
    "committed rounds are mapped to fragments by K",
    "streaming.assign": "each fragment keeps its own outer optimizer state and reference weights for the "
    "parameters assigned to it",
    "privacy": PRIVACY_FIXED,
}


def fixed_reason(path: str) -> str | None:
    """Why the dotted field `path` cannot change during a run, or None when it can. A change of a
    whole section (`streaming`: on or off) touches the fixed fields inside it."""
    for field, why in FIXED_FIELDS.items():
        if path == field or path.startswith(field + ".") or field.startswith(path + "."):
            return why
    return None


def _deep_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def config_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> dict[str, list[Any]]:
    """Dotted path -> [old, new] for every leaf that differs."""
    diff: dict[str, list[Any]] = {}
    for key in sorted(set(old) | set(new)):
        path = f"{prefix}{key}"
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diff.update(config_diff(a, b, f"{path}."))
        elif a != b:
            diff[path] = [a, b]
    return diff


def patch_of(diff: dict[str, list[Any]]) -> dict[str, Any]:
    """The merge patch that makes a `config_diff`'s changes: {"a.b": [old, new]} -> {"a": {"b": new}}."""
    patch: dict[str, Any] = {}
    for path, (_, new) in diff.items():
        *parents, leaf = path.split(".")
        node = patch
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = new
    return patch


#: Outer hyperparameters whose default depends on the algorithm (`outer_defaults`).
ALGORITHM_HYPERPARAMETERS = ("lr", "momentum", "nesterov")


def _with_algorithm_defaults(old: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A switch of `outer.algorithm` that does not set lr, momentum or nesterov itself takes the
    new algorithm's defaults for them: DiLoCo's outer lr of 0.7 kept under FedAdam (whose
    default is 0.01) diverges the model within a few rounds."""
    outer = patch.get("outer")
    if not isinstance(outer, dict) or "algorithm" not in outer:
        return patch
    if outer["algorithm"] == old.get("outer", {}).get("algorithm"):
        return patch
    reset = {k: None for k in ALGORITHM_HYPERPARAMETERS if k not in outer}
    return {**patch, "outer": {**outer, **reset}}


def change_notes(old: RunConfig, new: RunConfig) -> list[str]:
    """What a change implies beyond its diff, in words (shown by the validation answer)."""
    notes = _mode_notes(old.schedule.mode, new.schedule.mode, new) + _compression_notes(old, new) \
        + download_notes(old, new)
    if old.outer.algorithm == new.outer.algorithm:
        return notes + _lr_notes(old, new)
    d = outer_defaults(new)
    chosen = ", ".join(
        f"{k} {d[k]}" + ("" if getattr(new.outer, k) is None else " (given)") for k in ALGORITHM_HYPERPARAMETERS
    )
    return [
        *notes,
        f"outer.algorithm {old.outer.algorithm} -> {new.outer.algorithm}: the new outer optimizer starts with fresh "
        f"state and runs with {chosen}; unset values are {new.outer.algorithm}'s defaults",
    ]


def _compression_notes(old: RunConfig, new: RunConfig) -> list[str]:
    a, b = old.train.compression, new.train.compression
    if a == b:
        return []
    note = (f"train.compression {a} -> {b} applies from each participant's next upload; with train.error_feedback "
            "what compression did not send yet is carried into that upload")
    return [note + ("; topk sends most of an update rounds later, through that residual" if b == "topk" else "")]


def _lr_notes(old: RunConfig, new: RunConfig) -> list[str]:
    """An unset DiLoCo outer lr follows min_participants and train.sync_every (`outer_defaults`):
    say so when a change of those moves it."""
    if new.outer.algorithm != "diloco" or old.outer.lr is not None or new.outer.lr is not None:
        return []
    was, now = outer_defaults(old)["lr"], outer_defaults(new)["lr"]
    if was == now:
        return []
    return [f"outer.lr is unset, so it follows the recommended table by min_participants and train.sync_every "
            f"(docs/quality.md): {was} -> {now} from the next round; set outer.lr to pin it"]


def _mode_notes(old: str, new: str, cfg: RunConfig) -> list[str]:
    """What a switch of schedule.mode into or out of asynchronous mode means (docs/schedule.md)."""
    if old == new or "async" not in (old, new):
        return []
    if new == "async":
        step = ("the outer step becomes the delayed Nesterov one, the momentum kept"
                if cfg.asynchronous.outer_step == "delayed_nesterov" else "the outer optimizer steps on every update")
        return [f"schedule.mode {old} -> async: the open round closes as rounds do, with the updates it has; from "
                f"the next one every update is applied as it arrives, one version each ({step}); `rounds` then "
                "counts applied updates"]
    late = (f"folded into the open round at a discount if at most max_staleness {cfg.max_staleness} rounds late"
            if cfg.late_uploads == "fold" else "refused (409): their participants train on from the current model")
    return [f"schedule.mode async -> {new}: from the next version on, rounds wait for their participants again; "
            f"updates still being trained from older versions arrive late and are {late}; the delayed Nesterov "
            "step's momentum is kept, its updates not yet in the momentum are not"]


def apply_change(
    current: RunConfig,
    patch: Any,
    *,
    source: str = "config change",
    update_bytes: Callable[[RunConfig], int] | None = None,
) -> tuple[RunConfig, dict]:
    """Validate a partial (merge-patch) change against the running config.

    Returns the new config and its diff; raises ConfigError naming the field and the reason
    when the result is invalid or touches a field fixed for the life of the run. With
    `update_bytes` (the size of one update of the run's model under a config), the new
    config must also hold one update (`check_upload_limit`)."""
    if not isinstance(patch, dict):
        raise ConfigError(f"{source}: expected a mapping of fields to change, got {type(patch).__name__}")
    old = current.model_dump(mode="json")
    new_cfg = parse_config(_deep_merge(old, _with_algorithm_defaults(old, patch)), source=source)
    diff = config_diff(old, new_cfg.model_dump(mode="json"))
    fixed = [p for p in diff if fixed_reason(p) is not None]
    if fixed:
        why = fixed_reason(fixed[0])
        raise ConfigError(f"{source}: {', '.join(fixed)} cannot change during a run ({why})")
    if update_bytes is not None:
        check_upload_limit(new_cfg, update_bytes(new_cfg), source=source)
    return new_cfg, diff
