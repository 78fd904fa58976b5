"""`fedtrain config show`: the config in force as YAML, saying what the run's model really is.

A run started with `--init-weights` federates a model of the user's own: the config's
`model` section (the built-in GPT's defaults) describes nothing there, so it is not shown
as if it did; the coordinator's description of the model takes its place (a custom model,
its file, its tensors and parameters). Light to import: no torch, no server stack.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedtrain.participant.client.coordinator_client import CoordinatorClient


def format_config_view(view: dict[str, Any]) -> str:
    """The YAML of `GET /v1/config`'s answer, with a header line naming its version."""
    import yaml

    pending = view["latest_version"] > view["version"]
    lines = [f"# config v{view['version']}, in force at round {view['round']}"
             + (f" (v{view['latest_version']} accepted, in force from a later round)" if pending else "")]
    config = dict(view["config"])
    model = view.get("model") or {}
    if model.get("source") == "custom" and "model" in config:
        source = f"--init-weights {model['init_weights']}" if model.get("init_weights") else "--init-weights"
        lines.append(f"# model: a custom model (the participants' own module; version 0 from {source}), "
                     "not the built-in recipe: the config's model section does not apply and is not shown")
        config["model"] = {
            "custom": True,
            "init_weights": model.get("init_weights"),
            "tensors": model["tensors"],
            "parameters": model["parameters"],
            "dtypes": model.get("dtypes", []),
        }
    return "\n".join(lines) + "\n" + yaml.safe_dump(config, sort_keys=False)


def show_config(args: argparse.Namespace, client: CoordinatorClient) -> int:
    with client:
        view = client.get_config(args.round)
    if args.json:
        print(json.dumps(view, indent=2))
    else:
        print(format_config_view(view), end="")
    return 0
