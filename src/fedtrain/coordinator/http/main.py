"""`fedtrain coordinator`: listening socket, tokens, state directory, endpoint file, then serve
until stopped.

The socket is bound before anything is written: a port already taken fails with one line and
leaves the state directory as it was (no run.db, no tokens.json in a directory never used).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
from pathlib import Path

from fedtrain.config import load_config
from fedtrain.coordinator.http.server import CoordinatorServer, bind, uvicorn_config
from fedtrain.coordinator.members.auth import Tokens
from fedtrain.coordinator.service import Coordinator
from fedtrain.coordinator.state.statelock import StateLock
from fedtrain.errors import ConfigError, StateError
from fedtrain.transport.allocator import tune_process

ENDPOINT_FILE = "endpoint.json"
TOKENS_FILE = "tokens.json"


def resolve_tokens(args: argparse.Namespace, state_dir: Path) -> tuple[Tokens, Path | None, str | None]:
    """Flags, then environment, then the state dir's tokens.json; else new tokens written there.
    Returns the tokens, the file they are in (None when they came from flags or environment),
    and a line telling the user where generated tokens were saved."""
    tokens = Tokens.from_env(args.token, args.admin_token)
    path = state_dir / TOKENS_FILE
    if tokens.participant:
        return tokens, None, None
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            return Tokens(list(saved["participant"]), tokens.admin or saved.get("admin")), path, None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StateError(f"{path} is not a valid tokens file: {e}") from None
    tokens = Tokens([Tokens.generate()], tokens.admin or Tokens.generate())
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"participant": tokens.participant, "admin": tokens.admin}, f)
    return tokens, path, f"no tokens given: generated a participant and an admin token in {path} (mode 600)"


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, or a StateError saying why not (port taken, address not ours)."""
    try:
        return bind(host, port)
    except OSError as e:
        hint = " (another coordinator? pick another --port, or --port 0 for any free one)" if port else ""
        raise StateError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None


def url_of(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def next_steps(scheme: str, host: str, port: int, tokens_file: Path | None) -> list[str]:
    """What to run next: a participant command line that reaches this coordinator, with its token
    from the tokens file or the environment (never the token itself: it would stay in the
    terminal's scrollback and the shell's history), and the dashboard's address."""
    wildcard = host in ("0.0.0.0", "::")
    url = url_of(scheme, "127.0.0.1" if wildcard else host, port)
    command = f"fedtrain participant --coordinator {url}"
    if tokens_file is not None:
        command += f" --token-file {shlex.quote(str(tokens_file.absolute()))}"
    lines = [f"start a participant: {command} --data stdlib:0/4"]
    if tokens_file is None:
        lines.append("  (with FEDTRAIN_TOKEN set to one of this run's participant tokens)")
    if wildcard:
        lines.append("  (from another machine: this machine's address instead of 127.0.0.1)")
    lines.append(f"dashboard: {url}/ (sign in with a token of this run; the admin token may change the config)")
    return lines


def config_file_lines(path: Path | None, diff: dict[str, list]) -> list[str]:
    """What to tell the operator when the --config of a restart differs from the stored run's."""
    if not diff:
        return []
    lines = [f"note: {path} differs from the config this run has stored; the stored config stays in force "
             "(restart with --apply-config to apply the file as a new config version, or change fields live "
             "with `fedtrain config set`):"]
    lines += [f"  {key}: {stored!r} (stored) vs {given!r} (file)" for key, (stored, given) in diff.items()]
    return lines


def run_coordinator(args: argparse.Namespace) -> int:
    config = load_config(args.config) if args.config is not None else None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    sock = listen(args.host, args.port)
    try:
        state_dir: Path = args.state_dir
        # Before anything in the directory is read or written: a second coordinator on it is
        # refused here, naming the one that holds it.
        lock = StateLock.acquire(state_dir)
        tokens, tokens_file, note = resolve_tokens(args, state_dir)
        tune_process()  # the fast path's process tuning; nothing with FEDTRAIN_FAST_IO=0
        service = Coordinator(
            state_dir, config, tokens, init_weights=args.init_weights, config_path=args.config, lock=lock,
            apply_config=getattr(args, "apply_config", False), recover=getattr(args, "recover", False),
        )
        service.open()
        for line in config_file_lines(args.config, service.config_file_diff):
            print(line, flush=True)
        host, port = sock.getsockname()[:2]
        scheme = "https" if args.tls_cert else "http"
        url = url_of(scheme, host, port)
        lock.record(url)
        (state_dir / ENDPOINT_FILE).write_text(json.dumps({"url": url, "pid": os.getpid()}))
        if note:
            print(note, flush=True)
        print(
            f"fedtrain coordinator: run {service.config.name!r} at round {service.version}"
            f"{' (finished)' if service.finished else ''}, {service.config.outer.algorithm}, serving on {url} "
            f"(state in {state_dir})",
            flush=True,
        )
        # The socket listens already: a participant started from these lines waits in its
        # backlog until uvicorn accepts it a moment later.
        print("\n".join(next_steps(scheme, host, port, tokens_file)), flush=True)
        server = CoordinatorServer(uvicorn_config(service, args.log_level, args.tls_cert, args.tls_key), service)
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
