"""`fedtrain coordinator`: listening socket, tokens, state directory, endpoint file, then serve
until stopped.

The socket is bound before anything is written: a port already taken fails with one line and
leaves the state directory as it was (no run.db, no admin-token in a directory never used).
The admin token lives apart (DIR/admin-token) from the participant tokens: the command line
printed for a participant names one site's token file, never a file with the admin token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import socket
from dataclasses import dataclass, field
from pathlib import Path

from fedtrain.config import load_config
from fedtrain.coordinator.http.server import CoordinatorServer, bind, uvicorn_config
from fedtrain.coordinator.members.auth import ADMIN, Identity, Tokens
from fedtrain.coordinator.service import Coordinator
from fedtrain.coordinator.state.statelock import StateLock
from fedtrain.errors import ConfigError, StateError
from fedtrain.transport.allocator import tune_process
from fedtrain.transport.send import close_send_pool

ENDPOINT_FILE = "endpoint.json"
TOKENS_FILE = "tokens.json"  # a legacy state dir's tokens (participant and admin); new ones have none
ADMIN_TOKEN_FILE = "admin-token"
SITE_TOKENS_DIR = "participant-tokens"
FIRST_SITE = "site-1"
LEGACY_NAME = "default"


@dataclass
class StartTokens:
    """The tokens a coordinator starts with (`resolve_tokens`): the tokens, a legacy tokens.json's
    participant tokens to keep as named tokens once the run is open, and lines to print."""

    tokens: Tokens
    legacy: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def write_secret(path: Path, secret: str) -> Path:
    """Write `secret` into a new file `path` readable by its owner only (mode 600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return path


def _read_legacy(path: Path) -> tuple[list[str], str | None]:
    """A legacy tokens.json's participant tokens and admin token."""
    try:
        saved = json.loads(path.read_text())
        admin = saved.get("admin")
        return [str(t) for t in saved["participant"]], str(admin) if admin else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise StateError(f"{path} is not a valid tokens file: {e}") from None


def _read_admin(path: Path) -> str | None:
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StateError(f"cannot read the admin token {path}: {e.strerror or e}") from None
    if not token or len(token.split()) != 1:
        raise StateError(f"{path} must hold one admin token")
    return token


def resolve_tokens(args: argparse.Namespace, state_dir: Path) -> StartTokens:
    """The admin token: the flag, else $FEDTRAIN_ADMIN_TOKEN, else DIR/admin-token, else a legacy
    DIR/tokens.json's (copied to DIR/admin-token), else a new one written there (mode 600).
    Participant tokens given at start: the flags, else $FEDTRAIN_TOKEN; else none, and a legacy
    tokens.json's become named tokens ("default") once the run is open (`adopt_legacy`)."""
    given = Tokens.from_env(args.token, args.admin_token)
    legacy_path, admin_path = state_dir / TOKENS_FILE, state_dir / ADMIN_TOKEN_FILE
    legacy, legacy_admin = _read_legacy(legacy_path) if legacy_path.is_file() else ([], None)
    start = StartTokens(Tokens(list(given.participant), given.admin), [] if given.participant else legacy)
    if start.tokens.admin is None:
        admin = _read_admin(admin_path)
        if admin is None:
            admin = legacy_admin or Tokens.generate()
            write_secret(admin_path, admin)
            start.notes.append(f"the admin token is in {admin_path} (mode 600): admin commands read it with "
                               f"--state-dir {shlex.quote(str(state_dir))}; it never goes to a site")
        start.tokens.admin = admin
    return start


def site_token_file(state_dir: Path, service: Coordinator, start: StartTokens) -> Path | None:
    """A file holding one site's participant token only, for the printed command: on a run's
    first start (no token given, none named) a token "site-1" is minted into
    DIR/participant-tokens/site-1.token; else such a file whose token still acts, if any."""
    if start.legacy:
        added = service.adopt_tokens(LEGACY_NAME, start.legacy)
        if added:
            start.notes.append(f"the participant tokens of {state_dir / TOKENS_FILE} are kept as named tokens "
                               f"{', '.join(added)} (it still holds the admin token too: hand a site a token of its "
                               "own, `fedtrain token add NAME`, never that file)")
    folder = state_dir / SITE_TOKENS_DIR
    if not start.tokens.participant and service.named_tokens() == 0:
        minted = service.mint_token(Identity(ADMIN, "start"), FIRST_SITE)
        path = write_secret(folder / f"{FIRST_SITE}.token", minted["token"])
        start.notes.append(f"minted participant token {FIRST_SITE!r} into {path} (mode 600): hand it to one site; "
                           "a token per site: `fedtrain token add NAME` (docs/security.md)")
        return path
    for path in sorted(folder.glob("*.token")) if folder.is_dir() else []:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            ident = service.tokens.identify(f"Bearer {path.read_text().strip()}")
            if ident is not None and not ident.is_admin:
                return path
    return None


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, or a StateError saying why not (port taken, address not ours)."""
    try:
        return bind(host, port)
    except OSError as e:
        hint = " (another coordinator? pick another --port, or --port 0 for any free one)" if port else ""
        raise StateError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None


def url_of(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def next_steps(scheme: str, host: str, port: int, token_file: Path | None, *, ca_cert: Path | None = None,
               own_model: bool = False, env_tokens: bool = False, state_dir: Path | None = None) -> list[str]:
    """What to run next: a participant command line that reaches this coordinator, with one site's
    token file (never the token itself: it would stay in the terminal's scrollback and the
    shell's history; never a file with the admin token), the CA to verify under TLS, and the
    dashboard's address. A run of `--init-weights` (`own_model`) is joined by the user's own
    training script: the built-in recipe's model would not match it."""
    wildcard = host in ("0.0.0.0", "::")
    url = url_of(scheme, "127.0.0.1" if wildcard else host, port)
    flags = f"--coordinator {url}"
    if token_file is not None:
        flags += f" --token-file {shlex.quote(str(token_file.absolute()))}"
    if ca_cert is not None:
        flags += f" --ca-cert {shlex.quote(str(ca_cert.absolute()))}"
    if own_model:
        lines = [f"start a participant: your own training script around fedtrain.Participant (README.md, "
                 "\"Participant API\"; examples/custom_model.py), with a model whose trainable parameters match "
                 f"--init-weights; reach the run with {flags}"]
    else:
        lines = [f"start a participant: fedtrain participant {flags} --data stdlib:0/4"]
    if env_tokens:
        lines.append("  (with FEDTRAIN_TOKEN set to one of this run's participant tokens)")
    elif token_file is None:
        where = f" --state-dir {shlex.quote(str(state_dir))}" if state_dir is not None else ""
        lines.append(f"  (with --token-file FILE of a site's own token: fedtrain token add NAME{where} --out FILE)")
    if ca_cert is not None:
        lines.append("  (--ca-cert: the CA that signed the certificate; a self-signed certificate is its own)")
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
        start = resolve_tokens(args, state_dir)
        tokens = start.tokens
        tune_process()  # the fast path's process tuning; nothing with FEDTRAIN_FAST_IO=0
        service = Coordinator(
            state_dir, config, tokens, init_weights=args.init_weights, config_path=args.config, lock=lock,
            apply_config=getattr(args, "apply_config", False), recover=getattr(args, "recover", False),
        )
        service.open()
        site_file = site_token_file(state_dir, service, start)
        for line in config_file_lines(args.config, service.config_file_diff):
            print(line, flush=True)
        host, port = sock.getsockname()[:2]
        scheme = "https" if args.tls_cert else "http"
        url = url_of(scheme, host, port)
        lock.record(url)
        endpoint = {"url": url, "pid": os.getpid()}
        ca_cert = (getattr(args, "ca_cert", None) or args.tls_cert) if args.tls_cert else None
        if ca_cert is not None:  # what `fedtrain ... --state-dir DIR` verifies the coordinator with
            endpoint["ca_cert"] = str(Path(ca_cert).absolute())
        (state_dir / ENDPOINT_FILE).write_text(json.dumps(endpoint))
        for note in start.notes:
            print(note, flush=True)
        print(
            f"fedtrain coordinator: run {service.config.name!r} at round {service.version}"
            f"{' (finished)' if service.finished else ''}, {service.config.outer.algorithm}, serving on {url} "
            f"(state in {state_dir})",
            flush=True,
        )
        # The socket listens already: a participant started from these lines waits in its
        # backlog until uvicorn accepts it a moment later.
        steps = next_steps(scheme, host, port, site_file, ca_cert=ca_cert,
                           own_model=args.init_weights is not None, env_tokens=bool(tokens.participant),
                           state_dir=state_dir)
        print("\n".join(steps), flush=True)
        server = CoordinatorServer(uvicorn_config(service, args.log_level, args.tls_cert, args.tls_key), service)
        server.run(sockets=[sock])
    finally:
        sock.close()
        close_send_pool()  # its idle threads would make this process's exit wait (`cli.commands.run`)
    return 0
