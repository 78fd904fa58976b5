"""`fedtrain coordinator`: tokens, state directory, endpoint file, then serve until stopped."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import uvicorn

from fedtrain.config import load_config
from fedtrain.coordinator.auth import Tokens
from fedtrain.coordinator.server import bind, tune_allocator, uvicorn_config
from fedtrain.coordinator.service import Coordinator
from fedtrain.errors import ConfigError, StateError

ENDPOINT_FILE = "endpoint.json"
TOKENS_FILE = "tokens.json"


def resolve_tokens(args: argparse.Namespace, state_dir: Path) -> tuple[Tokens, str | None]:
    """Flags, then environment, then the state dir's tokens.json; else new tokens written there.
    Returns the tokens and a line telling the user where generated tokens were saved."""
    tokens = Tokens.from_env(args.token, args.admin_token)
    path = state_dir / TOKENS_FILE
    if tokens.participant:
        return tokens, None
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            return Tokens(list(saved["participant"]), tokens.admin or saved.get("admin")), None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StateError(f"{path} is not a valid tokens file: {e}") from None
    tokens = Tokens([Tokens.generate()], tokens.admin or Tokens.generate())
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"participant": tokens.participant, "admin": tokens.admin}, f)
    return tokens, f"no tokens given: generated a participant and an admin token in {path} (mode 600)"


def run_coordinator(args: argparse.Namespace) -> int:
    config = load_config(args.config) if args.config is not None else None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    state_dir: Path = args.state_dir
    tokens, note = resolve_tokens(args, state_dir)
    tune_allocator()
    service = Coordinator(state_dir, config, tokens, init_weights=args.init_weights, config_path=args.config)
    service.open()
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        raise StateError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    host, port = sock.getsockname()[:2]
    scheme = "https" if args.tls_cert else "http"
    url = f"{scheme}://{host}:{port}"
    (state_dir / ENDPOINT_FILE).write_text(json.dumps({"url": url, "pid": os.getpid()}))
    if note:
        print(note, flush=True)
    print(
        f"fedtrain coordinator: run {service.config.name!r} at round {service.version}"
        f"{' (finished)' if service.finished else ''}, {service.outer.algorithm}, serving on {url} "
        f"(state in {state_dir})",
        flush=True,
    )
    server = uvicorn.Server(uvicorn_config(service, args.log_level, args.tls_cert, args.tls_key))
    server.run(sockets=[sock])
    return 0
