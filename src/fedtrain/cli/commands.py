"""The `fedtrain` command: coordinator | participant | demo | status | config | export | recipes.
This module runs a parsed command (its arguments are `parser`'s) and ends the process.

Every command turns fedtrain errors, and the OSErrors of its own files and pipes, into one
line on stderr and exit status 2 (never a traceback); a reader that goes away (`| head`) ends
it quietly; Ctrl+C is a clean stop with status 130.

More: docs/architecture.md, "cli/commands.py".
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import fedtrain.cli.admin_commands as cli_admin
import fedtrain.cli.profile as profile
from fedtrain.cli.parser import DEFAULT_PORT, build_parser
from fedtrain.errors import ConfigError, FedtrainError

if TYPE_CHECKING:
    from fedtrain.participant.client.coordinator_client import CoordinatorClient

__all__ = ["COMMANDS", "DEFAULT_PORT", "build_parser", "main", "read_token_file", "run"]

EXIT_READER_GONE = 128 + 13  # what a shell reports for a process killed by SIGPIPE
log = logging.getLogger("fedtrain.cli")


def _token(args: argparse.Namespace, *, admin: bool = False) -> str:
    """--token, else --token-file, else the environment, else a state dir's admin token
    (`profile.token`). Admin commands look for the admin token first, the others for a
    participant token."""
    return profile.token(args, read_token_file, admin=admin)


def read_token_file(path: Path, *, admin: bool = False) -> str:
    """The token in `path`: its whole content stripped, or from a coordinator's tokens.json
    ({"participant": [...], "admin": ...}) the admin token if `admin` and it has one, else the
    first participant token."""
    try:
        text = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read the token file {path}: {e.strerror or e}") from None
    if text.startswith("{"):
        try:
            saved = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"token file {path}: not valid JSON ({e})") from None
        participant = saved.get("participant")  # a JSON text that starts with "{" is an object
        if admin and isinstance(saved.get("admin"), str) and saved["admin"]:
            return str(saved["admin"])
        if isinstance(participant, list) and participant and isinstance(participant[0], str) and participant[0]:
            return participant[0]
        raise ConfigError(f"token file {path}: expected a tokens.json with a \"participant\" list of tokens")
    if not text or len(text.split()) != 1:
        raise ConfigError(f"token file {path}: expected one token, found {'nothing' if not text else 'several words'}")
    return text


def _verify(args: argparse.Namespace) -> bool | str:
    if args.insecure:
        return False
    return profile.ca_cert(args) or True


def run() -> NoReturn:
    """The console script (`fedtrain`, `python -m fedtrain`): `main`, then the process ends.

    A process that imported torch spends ~0.6 s of CPU tearing its modules down at a normal
    exit, after everything of ours is closed. So once no other thread but daemon threads is
    left (the interpreter never waits for those: they stop where they are, as they would at a
    normal exit), the exit handlers run (logging's flush, multiprocessing's reaping, temp dirs)
    and the process ends at once. With another thread still running, the exit is the normal
    one (it waits for the thread), with the objects alive now frozen first (`gc.freeze`): the
    interpreter's last garbage collections then skip torch's ~300k module objects, most of the
    teardown's time (~2.5 s of ~3 s on a loaded 2-core machine).
    """
    code = main()
    if any(t is not threading.current_thread() and not t.daemon for t in threading.enumerate()):
        gc.freeze()
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    try:
        code = _run(argv)
    except SystemExit as e:  # argparse, after --help, --version or a usage error
        code = e.code if isinstance(e.code, int) else 2
    except BrokenPipeError:
        return _drop_stdout(EXIT_READER_GONE)
    return _flush_stdout(code)


def _flush_stdout(code: int) -> int:
    """Flush stdout now, so that a reader that went away (`| head`) or a full disk shows here,
    as a quiet exit or one line, and not as a warning from Python's own flush at exit."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return _drop_stdout(EXIT_READER_GONE)
    except OSError as e:
        if code == 0:  # a command that failed has said so already: one line per error
            print(f"fedtrain: error: cannot write the output: {e.strerror or e}", file=sys.stderr)
        return _drop_stdout(code or 2)
    return code


def _run(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["torchrun"]:  # everything after it is torchrun's, --help included
        from fedtrain.participant.ranks.torchrun import launch

        return launch(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where a shell started us ignoring it
    name = " ".join(filter(None, [args.command, getattr(args, "action", None)]))
    try:
        from fedtrain import faults

        faults.arm_from_env()  # FEDTRAIN_FAULTS: crash this process at a named point (tests, chaos runs)
        quiet = logging.getLogger("fedtrain.participant")
        level = quiet.level  # `_client` may quiet it: put back for a caller that runs main in-process
        try:
            return int(COMMANDS[args.command](args) or 0)
        finally:
            quiet.setLevel(level)
    except FedtrainError as e:
        print(f"fedtrain {name}: error: {e.message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # the reader of stdout is gone: `main` ends quietly
    except OSError as e:  # a file or pipe of our own: one line too; the traceback at --log-level debug
        log.debug("fedtrain %s failed", name, exc_info=True)
        where = f": {e.filename}" if e.filename else ""
        print(f"fedtrain {name}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fedtrain {name}: stopped", file=sys.stderr)
        return 130


def _drop_stdout(code: int) -> int:
    """Point stdout at /dev/null (the recipe of the `signal` docs for SIGPIPE): what is still
    buffered can go nowhere, and Python's flush at exit must not fail on it again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor behind stdout (an embedding host)
        pass
    return code


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def cmd_coordinator(args: argparse.Namespace) -> int:
    from fedtrain.coordinator.http.main import run_coordinator

    return run_coordinator(args)


def cmd_participant(args: argparse.Namespace) -> int:
    from fedtrain.participant.client.coordinator_client import RetryPolicy
    from fedtrain.recipes.train import run_participant

    result = run_participant(
        profile.coordinator_url(args),
        _token(args),
        args.data,
        name=args.name,
        threads=args.threads,
        verify=_verify(args),
        retry=RetryPolicy(max_elapsed_s=args.give_up_after),
        run_dir=args.run_dir,
        device=args.device,
        parallel=args.parallel,
        speed=args.speed,
    )
    print(json.dumps(result))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fedtrain.cli.demo import run_demo

    return run_demo(args)


def cmd_status(args: argparse.Namespace) -> int:
    from fedtrain.cli.report import eval_rows, format_status

    if args.watch is not None:
        return cli_admin.run_status_watch(args, _client(args))
    with _client(args) as client:
        status = client.status()
        status["evals"] = eval_rows(client.metrics())
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def _client(args: argparse.Namespace, *, admin: bool = False) -> CoordinatorClient:
    """A CoordinatorClient for a one-shot command: it gives up after 5 s without an answer."""
    from fedtrain.participant.client.coordinator_client import CoordinatorClient, RetryPolicy

    if args.log_level != "debug":  # its retries are not news here: the one line at the end says what failed
        logging.getLogger("fedtrain.participant").setLevel(logging.ERROR)
    return CoordinatorClient(
        profile.coordinator_url(args), _token(args, admin=admin), verify=_verify(args),
        retry=RetryPolicy(max_elapsed_s=5),
    )


def cmd_config(args: argparse.Namespace) -> int:
    if args.action == "show":  # the config in force, and what the run's model really is (cli/config_show.py)
        from fedtrain.cli.config_show import show_config

        return show_config(args, _client(args))
    return cli_admin.run_config(args, _client(args, admin=cli_admin.is_admin_action(args)))


def cmd_rollback(args: argparse.Namespace) -> int:
    return cli_admin.run_rollback(args, _client(args, admin=True))


def cmd_evict(args: argparse.Namespace) -> int:
    return cli_admin.run_evict(args, _client(args, admin=True))


def cmd_token(args: argparse.Namespace) -> int:
    return cli_admin.run_token(args, _client(args, admin=True))


def cmd_export(args: argparse.Namespace) -> int:
    from fedtrain.export import export_model

    def connect() -> CoordinatorClient:  # for an export from a coordinator (not from a state dir)
        from fedtrain.participant.client.coordinator_client import CoordinatorClient, RetryPolicy

        return CoordinatorClient(
            args.coordinator, _token(args), verify=_verify(args), retry=RetryPolicy(max_elapsed_s=10)
        )

    profile.export_source(args)
    version, n, digest = export_model(args, connect)
    print(f"wrote {args.out}: global model version {version}, {n} tensors, {digest}")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from fedtrain.config import RECIPES_DIR, recipe_path

    if args.name is not None:
        print(recipe_path(args.name).read_text(), end="")
        return 0
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        first = path.read_text().splitlines()[0].lstrip("# ").strip()
        print(f"{path.stem:24} {first}")
    return 0


COMMANDS = {
    "coordinator": cmd_coordinator,
    "participant": cmd_participant,
    "demo": cmd_demo,
    "status": cmd_status,
    "config": cmd_config,
    "export": cmd_export,
    "rollback": cmd_rollback,
    "evict": cmd_evict,
    "token": cmd_token,
    "recipes": cmd_recipes,
}

if __name__ == "__main__":
    sys.exit(main())
