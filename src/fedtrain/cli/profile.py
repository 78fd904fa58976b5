"""Where a client command finds its coordinator, its token and the CA to verify it with, so that
a command is short: its flags, else the environment, else a coordinator's state directory.

    URL    --coordinator, else $FEDTRAIN_COORDINATOR, else DIR/endpoint.json
    token  --token, else --token-file, else for an admin command $FEDTRAIN_ADMIN_TOKEN_FILE,
           $FEDTRAIN_ADMIN_TOKEN, DIR/admin-token, then $FEDTRAIN_TOKEN_FILE, $FEDTRAIN_TOKEN;
           for the others the participant's first, then the admin's
    CA     --ca-cert, else $FEDTRAIN_CA_CERT, else DIR/endpoint.json's (a coordinator with TLS)

DIR is `--state-dir` or $FEDTRAIN_STATE_DIR: the state directory of a coordinator on this
machine (the admin's own machine; a participant never reads one). Light to import: no torch.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from fedtrain.errors import ConfigError, FedtrainError

PROFILE_HELP = (
    "Defaults: --coordinator from $FEDTRAIN_COORDINATOR, the token from $FEDTRAIN_ADMIN_TOKEN_FILE / "
    "$FEDTRAIN_TOKEN_FILE (or $FEDTRAIN_ADMIN_TOKEN / $FEDTRAIN_TOKEN), --ca-cert from $FEDTRAIN_CA_CERT; "
    "else from --state-dir DIR (or $FEDTRAIN_STATE_DIR): DIR/endpoint.json and DIR/admin-token."
)


def add_state_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                   help="a coordinator's state directory on this machine: its URL (endpoint.json), admin token "
                   "(admin-token) and CA, when not given otherwise (default $FEDTRAIN_STATE_DIR)")


def state_dir(args: argparse.Namespace) -> Path | None:
    given = getattr(args, "state_dir", None)
    if given is not None:
        return Path(given)
    env = os.environ.get("FEDTRAIN_STATE_DIR", "").strip()
    return Path(env) if env and hasattr(args, "state_dir") else None


def _endpoint(directory: Path) -> dict[str, Any]:
    path = directory / "endpoint.json"
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: is {directory} the state directory of a coordinator that "
                          "started?") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(found, dict) or not isinstance(found.get("url"), str):
        raise ConfigError(f"{path} holds no coordinator URL")
    return found


def coordinator_url(args: argparse.Namespace) -> str:
    """--coordinator, else $FEDTRAIN_COORDINATOR, else the state dir's endpoint.json."""
    if getattr(args, "coordinator", None):
        return str(args.coordinator)
    env = os.environ.get("FEDTRAIN_COORDINATOR", "").strip()
    if env:
        return env
    directory = state_dir(args)
    if directory is not None:
        return str(_endpoint(directory)["url"])
    more = ", or --state-dir DIR of a coordinator on this machine" if hasattr(args, "state_dir") else ""
    raise FedtrainError(f"no coordinator: pass --coordinator URL or set FEDTRAIN_COORDINATOR{more}")


def ca_cert(args: argparse.Namespace) -> str | None:
    """--ca-cert, else $FEDTRAIN_CA_CERT, else the CA a coordinator with TLS wrote to endpoint.json."""
    if getattr(args, "ca_cert", None):
        return str(args.ca_cert)
    env = os.environ.get("FEDTRAIN_CA_CERT", "").strip()
    if env:
        return env
    directory = state_dir(args)
    if directory is not None and not getattr(args, "coordinator", None):
        ca = _endpoint(directory).get("ca_cert")
        return str(ca) if isinstance(ca, str) else None
    return None


def token(args: argparse.Namespace, read_file: Any, *, admin: bool = False) -> str:
    """--token, else --token-file, else the environment, else DIR/admin-token (see the module's
    docstring). `read_file(path, admin=...)`: how a token file is read (`commands.read_token_file`)."""
    if getattr(args, "token", None):
        return str(args.token)
    if getattr(args, "token_file", None) is not None:
        return str(read_file(args.token_file, admin=admin))
    directory = state_dir(args)
    saved = directory / "admin-token" if directory is not None else None
    # An admin command: the admin's token before a participant's; the others: the other way round.
    for source in (["ADMIN_", saved, ""] if admin else ["", "ADMIN_", saved]):
        if isinstance(source, Path):
            if source.is_file():
                return str(read_file(source, admin=admin))
            continue
        if source is None:
            continue
        path = os.environ.get(f"FEDTRAIN_{source}TOKEN_FILE", "").strip()
        if path:
            return str(read_file(Path(path), admin=admin))
        value = os.environ.get(f"FEDTRAIN_{source}TOKEN", "").split(",")[0].strip()
        if value:
            return value
    wanted = "FEDTRAIN_ADMIN_TOKEN_FILE" if admin else "FEDTRAIN_TOKEN_FILE"
    more = " or --state-dir DIR" if hasattr(args, "state_dir") else ""
    raise FedtrainError(f"no token: pass --token-file PATH (or --token){more}, or set {wanted}")


EXPORT_HELP = (
    "The model comes from --coordinator URL, else --state-dir DIR (read directly), else $FEDTRAIN_COORDINATOR, else "
    "$FEDTRAIN_STATE_DIR. From a coordinator, without --token or --token-file: $FEDTRAIN_TOKEN_FILE or "
    "$FEDTRAIN_TOKEN, else the admin's ($FEDTRAIN_ADMIN_TOKEN_FILE, $FEDTRAIN_ADMIN_TOKEN); --ca-cert defaults to "
    "$FEDTRAIN_CA_CERT."
)


def export_source(args: argparse.Namespace) -> None:
    """Where `export` reads the model when neither --coordinator nor --state-dir is given: the
    coordinator at $FEDTRAIN_COORDINATOR (its token from the environment, as every client command
    finds it), else the state directory $FEDTRAIN_STATE_DIR read directly."""
    if args.coordinator or args.state_dir is not None:
        return
    url = os.environ.get("FEDTRAIN_COORDINATOR", "").strip()
    directory = os.environ.get("FEDTRAIN_STATE_DIR", "").strip()
    if url:
        args.coordinator = url
    elif directory:
        args.state_dir = Path(directory)
    else:
        raise FedtrainError("no model to export: pass --coordinator URL (a running coordinator) or --state-dir DIR "
                            "(its state directory on this machine), or set FEDTRAIN_COORDINATOR or FEDTRAIN_STATE_DIR")
