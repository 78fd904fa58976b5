"""The admin's commands of `fedtrain`: `config show | set | validate | history` and `rollback`.

Both speak to a running coordinator through `CoordinatorClient` (built by `cli.py`, which
owns tokens and TLS) and print what it answered in one line or a table; a refusal is the
coordinator's own message. Light to import, like `cli.py`: no torch, no server stack.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

from fedtrain.errors import ConfigError

if TYPE_CHECKING:
    from fedtrain.participant.client.coordinator_client import CoordinatorClient

CHANGE_HELP = "a dotted field and its value, e.g. train.sync_every=30 outer.lr=0.5 (JSON, else YAML)"
ENV_HELP = (
    "Without --token or --token-file: $FEDTRAIN_TOKEN (the first, if comma-separated), else $FEDTRAIN_ADMIN_TOKEN."
)
ADMIN_ENV_HELP = "Without --token or --token-file: $FEDTRAIN_ADMIN_TOKEN, else $FEDTRAIN_TOKEN."


def is_admin_action(args: argparse.Namespace) -> bool:
    """Whether the command needs the admin token (the others read with any run token)."""
    return args.command == "rollback" or getattr(args, "action", None) in ("set", "validate")


def add_config_parser(sub: Any, client: argparse.ArgumentParser) -> None:
    """`fedtrain config show | set | validate | history`: the live config over the coordinator's API."""
    cfg = sub.add_parser(
        "config",
        help="show, change, check or list the live run config of a coordinator",
        description="The run config, live: changes are validated by the coordinator and in force from the "
        "next round boundary. KEY is a dotted field (train.sync_every, outer.lr); VALUE is read as JSON, "
        "else YAML (30 is a number, true a boolean, null clears, anything else is text).",
    )
    actions = cfg.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", parents=[client], help="print the config in force (YAML)", epilog=ENV_HELP)
    show.add_argument("--round", type=int, default=None, help="the config in force at this round instead")
    show.add_argument("--json", action="store_true", help="print the coordinator's JSON answer")
    change = actions.add_parser(
        "set", parents=[client], help="admin: change fields, in force from the next round boundary",
        epilog=ADMIN_ENV_HELP,
    )
    change.add_argument("changes", nargs="+", metavar="KEY=VALUE", help=CHANGE_HELP)
    check = actions.add_parser(
        "validate", parents=[client], help="admin: check a change without applying it", epilog=ADMIN_ENV_HELP
    )
    check.add_argument("changes", nargs="+", metavar="KEY=VALUE", help=CHANGE_HELP)
    history = actions.add_parser(
        "history", parents=[client], help="accepted config versions: when, by whom, what changed", epilog=ENV_HELP
    )
    history.add_argument("--limit", type=int, default=50, help="newest versions to list (default 50)")
    history.add_argument("--json", action="store_true", help="print the coordinator's JSON answer")


def add_rollback_parser(sub: Any, client: argparse.ArgumentParser) -> None:
    """`fedtrain rollback [--version V]`: list the kept versions, or put one back in force."""
    rb = sub.add_parser(
        "rollback",
        parents=[client],
        help="admin: put a kept version of the global model back in force (without --version: list them)",
        description="The open round closes with no updates and the next version holds the kept version's weights "
        "and outer optimizer state; recorded as a round and an event. Admin token.",
        epilog=ADMIN_ENV_HELP,
    )
    rb.add_argument("--version", type=int, default=None, help="the kept version to go back to")


def parse_changes(pairs: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` pairs as the nested merge patch of `PUT /v1/config`: `train.sync_every=30`
    is {"train": {"sync_every": 30}}. A value is read as JSON, else as YAML (so `1e-3` is a
    number, `fedadam` text, `null` clears a field)."""
    import yaml

    patch: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(p.strip() for p in parts):
            raise ConfigError(f"{pair!r}: expected KEY=VALUE with a dotted KEY, e.g. train.sync_every=30")
        if not raw.strip():
            raise ConfigError(f"{pair!r}: give a value (null to clear the field)")
        try:
            value = json.loads(raw)
        except ValueError:
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError:
                value = raw
        node = patch
        for i, part in enumerate(parts):
            here = ".".join(parts[: i + 1])
            if i == len(parts) - 1:
                if part in node:
                    raise ConfigError(f"{here} is given twice")
                node[part] = value
            else:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{here} is given both as a value and as a section")
    return patch


def _show_value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def format_diff(diff: dict[str, list[Any]]) -> str:
    """`train.sync_every: 5 -> 30, outer.lr: 0.7 -> 0.5`, the form of the coordinator's events."""
    return ", ".join(f"{k}: {_show_value(a)} -> {_show_value(b)}" for k, (a, b) in diff.items())


def format_history(versions: list[dict[str, Any]]) -> str:
    from fedtrain.cli.report import table

    rows = [
        [
            f"v{v['version']}",
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v["created_at"])),
            v["author"],
            v["effective_round"],
            format_diff(v["diff"]) or "(the run's first config)",
        ]
        for v in versions
    ]
    return table(["version", "time", "author", "from round", "changes"], rows)


def run_config(args: argparse.Namespace, client: CoordinatorClient) -> int:
    patch = parse_changes(args.changes) if is_admin_action(args) else {}
    with client:
        if args.action == "show":
            view = client.get_config(args.round)
            if args.json:
                print(json.dumps(view, indent=2))
            else:
                import yaml

                pending = view["latest_version"] > view["version"]
                print(f"# config v{view['version']}, in force at round {view['round']}"
                      + (f" (v{view['latest_version']} accepted, in force from a later round)" if pending else ""))
                print(yaml.safe_dump(view["config"], sort_keys=False), end="")
        elif args.action == "history":
            versions = client.config_history(args.limit)
            print(json.dumps(versions, indent=2) if args.json else format_history(versions))
        elif args.action == "validate":
            answer = client.validate_config(patch)
            if not answer["valid"]:
                raise ConfigError(answer["error"])
            print(f"valid: {format_diff(answer['diff']) or 'no change (the config has these values)'}; "
                  "nothing applied")
            for note in answer.get("notes", []):
                print(f"note: {note}")
        else:
            answer = client.change_config(patch)
            if not answer["changed"]:
                print(f"no change: config v{answer['version']} has these values already")
            else:
                print(f"config v{answer['version']} accepted, in force from round {answer['effective_round']}: "
                      f"{format_diff(answer['diff'])}")
            for note in answer.get("notes", []):
                print(f"note: {note}")
    return 0


def run_rollback(args: argparse.Namespace, client: CoordinatorClient) -> int:
    with client:
        if args.version is None:
            kept = client.kept_versions()
            print(f"committed version {kept['committed_version']}; kept versions (newest first): "
                  f"{', '.join(map(str, kept['versions'])) or 'none'}")
            return 0
        answer = client.roll_back(args.version)
    print(f"rolled back: version {answer['version']} holds the weights and optimizer state of version "
          f"{answer['restored']}; participants fetch it at their next sync")
    return 0
