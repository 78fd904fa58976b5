"""The admin's commands of `fedtrain`: `config show | set | validate | history`, `rollback`,
`evict`, `token add | list | revoke`, and `status --watch`.

Both speak to a running coordinator through `CoordinatorClient` (built by `cli.py`, which
owns tokens and TLS) and print what it answered in one line or a table; a refusal is the
coordinator's own message. Light to import, like `cli.py`: no torch, no server stack.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedtrain.errors import ConfigError

if TYPE_CHECKING:
    from fedtrain.participant.client.coordinator_client import CoordinatorClient

CHANGE_HELP = "a dotted field and its value, e.g. train.sync_every=30 outer.lr=0.5 (JSON, else YAML)"
ENV_HELP = (
    "Without --token or --token-file: $FEDTRAIN_TOKEN_FILE or $FEDTRAIN_TOKEN (the first, if comma-separated), "
    "else the admin's ($FEDTRAIN_ADMIN_TOKEN_FILE, $FEDTRAIN_ADMIN_TOKEN; with --state-dir DIR, DIR/admin-token). "
    "--coordinator defaults to $FEDTRAIN_COORDINATOR (else DIR/endpoint.json), --ca-cert to $FEDTRAIN_CA_CERT."
)
ADMIN_ENV_HELP = (
    "Without --token or --token-file: $FEDTRAIN_ADMIN_TOKEN_FILE or $FEDTRAIN_ADMIN_TOKEN, else --state-dir DIR's "
    "admin-token, else $FEDTRAIN_TOKEN_FILE / $FEDTRAIN_TOKEN. --coordinator defaults to $FEDTRAIN_COORDINATOR, "
    "else DIR/endpoint.json (DIR: --state-dir or $FEDTRAIN_STATE_DIR); docs/security.md."
)


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
        if args.action == "history":  # "show" is cli/config_show.py's
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


# -- evictions, tokens per site, a status that follows the run -------------------------------------

TOKEN_OUT_HELP = (
    "write the token into this new file (mode 600) to hand to the site, instead of printing it; the coordinator "
    "keeps only its sha256, so this is the one time it is shown"
)
MIN_WATCH_S = 0.2


def watch_interval(text: str) -> float:
    """--watch's value: a number of seconds, at least MIN_WATCH_S (argparse's error otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= MIN_WATCH_S or value > 86400:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text} is not between {MIN_WATCH_S} and 86400 seconds")
    return value


def add_evict_parser(sub: Any, client: argparse.ArgumentParser) -> None:
    """`fedtrain evict PARTICIPANT`: remove a participant from the run."""
    ev = sub.add_parser(
        "evict", parents=[client], help="admin: remove a participant from the run (it may not rejoin as that name)",
        description="The participant is out of the run: its requests are refused and its name may not rejoin. For "
        "eviction_cooldown_s its token may add no participants (its site's token only: other sites' tokens are "
        "not affected). To shut a site out for good, revoke its token: fedtrain token revoke NAME. Admin token.",
        epilog=ADMIN_ENV_HELP,
    )
    ev.add_argument("participant", metavar="PARTICIPANT", help="the participant's id (fedtrain status lists them)")


def add_token_parser(sub: Any, client: argparse.ArgumentParser) -> None:
    """`fedtrain token add | list | revoke`: the run's participant tokens, one per site."""
    tok = sub.add_parser(
        "token",
        help="admin: mint, list or revoke participant tokens (one per site) of a running coordinator",
        description="Participant tokens per site, changed while the run goes on. The coordinator stores only each "
        "token's sha256: `token add` shows a token once. A revoked token is refused from then on and its "
        "participants are evicted. Admin token.",
    )
    actions = tok.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = actions.add_parser("add", parents=[client], help="mint a token for a site", epilog=ADMIN_ENV_HELP)
    add.add_argument("name", metavar="NAME", help="the site's name, e.g. site-a (1-64 letters, digits, _ . -)")
    add.add_argument("--out", type=Path, default=None, metavar="FILE", help=TOKEN_OUT_HELP)
    ls = actions.add_parser("list", parents=[client], help="list the tokens and who joined with each",
                            epilog=ADMIN_ENV_HELP)
    ls.add_argument("--json", action="store_true", help="print the coordinator's JSON answer")
    rv = actions.add_parser("revoke", parents=[client], help="revoke a token; its participants are evicted",
                            epilog=ADMIN_ENV_HELP)
    which = rv.add_mutually_exclusive_group(required=True)
    which.add_argument("name", nargs="?", default=None, metavar="NAME", help="the token's name")
    which.add_argument("--id", dest="token_id", default=None, metavar="TOKEN_ID",
                       help="the token's fingerprint (fedtrain token list), e.g. for a token given at start")
    which.add_argument("--participant", default=None, metavar="ID", help="the token this participant joined with")


def run_evict(args: argparse.Namespace, client: CoordinatorClient) -> int:
    with client:
        answer = client.evict(args.participant)
    print(f"evicted {answer['evicted']}: it may not rejoin; its token adds no participants for eviction_cooldown_s")
    return 0


def run_token(args: argparse.Namespace, client: CoordinatorClient) -> int:
    if args.action == "add" and args.out is not None and args.out.exists():
        raise ConfigError(f"{args.out} exists already: choose a new file for the token")
    with client:
        if args.action == "list":
            listed = client.list_tokens()
            print(json.dumps(listed, indent=2) if args.json else format_tokens(listed))
        elif args.action == "revoke":
            answer = client.revoke_token(name=args.name, token_id=args.token_id, participant_id=args.participant)
            print(f"revoked token {answer['revoked']}; evicted: {', '.join(answer['evicted']) or 'none'}")
        else:
            minted = client.mint_token(args.name)
            _hand_out(minted, args.out)
    return 0


def _hand_out(minted: dict[str, Any], out: Path | None) -> None:
    """The minted token into `out` (mode 600), or alone on stdout (`> site-a.token` keeps it) with
    what it is on stderr: either way the one time it is shown."""
    what = f"minted participant token {minted['name']!r} ({minted['token_id']})"
    if out is None:
        print(minted["token"])
        print(f"{what}: shown this once; hand it to the site (fedtrain participant --token-file FILE)",
              file=sys.stderr)
        return
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(minted["token"] + "\n")
    print(f"{what} into {out} (mode 600): hand it to the site (fedtrain participant --token-file {out})")


def format_tokens(tokens: list[dict[str, Any]]) -> str:
    from fedtrain.cli.report import table

    rows = [
        [
            t.get("name") or "-",
            t["token_id"],
            t.get("source", "-"),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(t["created_at"])) if t.get("created_at") else "-",
            "revoked" if t["revoked"] else "live",
            ", ".join(t["participants"]) or "-",
        ]
        for t in tokens
    ]
    return table(["name", "token_id", "source", "created", "state", "participants"], rows) if rows else "no tokens"


def run_status_watch(args: argparse.Namespace, client: CoordinatorClient) -> int:
    """`fedtrain status --watch S`: the status again every S seconds (the screen cleared between
    two on a terminal), until the run finishes (0) or Ctrl+C (130, by `commands.main`). A
    coordinator out of reach is one line, and the watch goes on; any other refusal ends it."""
    from fedtrain.cli.report import eval_rows, format_status
    from fedtrain.errors import CoordinatorUnavailable

    clear = sys.stdout.isatty() and not args.json
    with client:
        while True:
            try:
                status = client.status()
                status["evals"] = eval_rows(client.metrics())
            except CoordinatorUnavailable as e:
                print(f"{time.strftime('%H:%M:%S')} coordinator out of reach: {e.message} (watching on)", flush=True)
            else:
                if clear:
                    print("\x1b[H\x1b[2J", end="")
                print(json.dumps(status) if args.json else format_status(status), flush=True)
                if status["finished"]:
                    return 0
                if not clear and not args.json:
                    print(flush=True)
            time.sleep(args.watch)
