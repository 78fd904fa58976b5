"""The `fedtrain` command: coordinator | participant | demo | status | config | export | recipes.

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

import fedtrain
import fedtrain.cli.admin_commands as cli_admin
import fedtrain.cli.profile as profile
from fedtrain.errors import ConfigError, FedtrainError

if TYPE_CHECKING:
    from fedtrain.participant.client.coordinator_client import CoordinatorClient

DEFAULT_PORT = 8000
EXIT_READER_GONE = 128 + 13  # what a shell reports for a process killed by SIGPIPE
log = logging.getLogger("fedtrain.cli")

TOKEN_HELP = (
    "bearer token; visible to every user of this machine in `ps`: prefer --token-file or $FEDTRAIN_TOKEN"
)
TOKEN_FILE_HELP = (
    "file holding the token: the token alone, or a coordinator's tokens.json (its first participant token; "
    "the admin token for admin commands)"
)
ENV_HELP = cli_admin.ENV_HELP


def _add_token_args(p: argparse.ArgumentParser) -> None:
    given = p.add_mutually_exclusive_group()
    given.add_argument("--token", default=None, help=TOKEN_HELP)
    given.add_argument("--token-file", type=Path, default=None, metavar="PATH", help=TOKEN_FILE_HELP)


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default=None, metavar="URL",
                   help="coordinator URL, e.g. http://HOST:8000 (default $FEDTRAIN_COORDINATOR)")
    _add_token_args(p)
    p.add_argument("--ca-cert", default=None, metavar="PEM",
                   help="CA bundle to verify the coordinator's TLS cert (default $FEDTRAIN_CA_CERT)")
    p.add_argument("--insecure", action="store_true", help="do not verify TLS certificates (testing only)")


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


def _speed(text: str) -> float:
    """--speed's value: a number above 0 and at most 1 (argparse's error otherwise, no traceback)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text} is not above 0 and at most 1 (1: full speed, 0.5: half)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedtrain",
        description="Fault-tolerant federated and DiLoCo training for PyTorch.",
        epilog="Tokens: a --token on the command line shows in `ps` to every user of the machine; "
        "prefer --token-file PATH or $FEDTRAIN_TOKEN. `fedtrain COMMAND --help` for each command.",
    )
    parser.add_argument("--version", action="version", version=f"fedtrain {fedtrain.__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    client_parent = argparse.ArgumentParser(add_help=False)  # --coordinator, the token, TLS, --state-dir
    _add_client_args(client_parent)
    profile.add_state_dir_arg(client_parent)

    c = sub.add_parser("coordinator", help="serve a run: hold the global model, merge updates")
    c.add_argument("--config", type=Path, default=None, help="run config (YAML or JSON); default: built-in recipe")
    c.add_argument("--state-dir", type=Path, default=Path("fedtrain-run"), help="where the run's state lives")
    c.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    c.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind (0: any free port)")
    c.add_argument(
        "--token",
        action="append",
        default=None,
        metavar="TOKEN",
        help="participant token (repeatable; default $FEDTRAIN_TOKEN, comma-separated, else DIR/tokens.json, "
        "else new ones written there); shows in `ps`: prefer the environment or tokens.json",
    )
    c.add_argument(
        "--admin-token", default=None, help="admin token (default $FEDTRAIN_ADMIN_TOKEN); shows in `ps` too"
    )
    c.add_argument(
        "--apply-config",
        action="store_true",
        help="resuming a stored run: apply --config as a new config version, with its diff (default: the stored "
        "config stays in force, and how --config differs from it is printed)",
    )
    c.add_argument(
        "--recover",
        action="store_true",
        help="if the newest checkpoint is damaged on disk, resume from the newest intact kept version "
        "(recorded as an event) instead of refusing to start",
    )
    c.add_argument("--init-weights", type=Path, default=None, help="initial global weights (.safetensors)")
    c.add_argument("--tls-cert", type=Path, default=None, help="TLS certificate (PEM)")
    c.add_argument("--tls-key", type=Path, default=None, help="TLS private key (PEM)")
    c.add_argument("--ca-cert", type=Path, default=None, metavar="PEM",
                   help="with TLS: the CA certificate participants verify --tls-cert with, printed into their "
                   "command line and DIR/endpoint.json (default: --tls-cert itself, right for a self-signed one)")

    p = sub.add_parser(
        "participant",
        help="train the run's recipe on local data and sync with a coordinator "
        "(also under torchrun --nproc_per_node N -m fedtrain participant ...)",
        epilog=ENV_HELP,
    )
    _add_client_args(p)
    p.add_argument(
        "--data",
        required=True,
        help="training text: a file or directory, or stdlib:K/N (shard K of N of Python's stdlib)",
    )
    p.add_argument("--name", default=None, help="stable participant name (restarts rejoin as the same one)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument(
        "--give-up-after",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long to keep training on and retrying while the coordinator is unreachable, before exiting "
        "(default 300)",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="local directory: checkpoint at every round boundary (a restart resumes from it), metrics.jsonl, "
        "TensorBoard events when installed, final weights",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to train (cuda: LOCAL_RANK's GPU)")
    p.add_argument(
        "--parallel",
        default="ddp",
        choices=["ddp", "fsdp"],
        help="how the ranks of a torchrun participant share the model: ddp (default) keeps a replica on every "
        "rank, rank 0 syncs; fsdp shards it with FSDP2 (fully_shard per layer), every rank syncs its own rows and "
        "--run-dir keeps a sharded checkpoint that resumes on any number of ranks. fsdp runs under torchrun only "
        "(--nproc_per_node 1 too)",
    )
    p.add_argument(
        "--speed",
        type=_speed,
        default=1.0,
        metavar="FACTOR",
        help="run the inner steps at FACTOR of their natural pace, 0 < FACTOR <= 1 (0.5: half speed, by sleeping "
        "after each step as long as it took): a slow site on purpose, for tests and demos (default 1)",
    )

    d = sub.add_parser("demo", help="a coordinator and N participants on this machine, then a summary")
    d.add_argument("--participants", type=int, default=None,
                   help="number of participants (default 4; 3 with --heterogeneous)")
    d.add_argument("--heterogeneous", action="store_true",
                   help="sites of different speed: participants at 1x, 0.5x, 0.25x (cycled) of their natural pace, "
                   "in balanced rounds unless --schedule says otherwise")
    d.add_argument("--schedule", default=None, choices=["rounds", "balanced", "async"],
                   help="schedule.mode of the demo's run (default: the config's; balanced with --heterogeneous)")
    d.add_argument("--streaming", type=int, default=None, metavar="K",
                   help="Streaming DiLoCo with K fragments (overlap 1, alpha 0.5; docs/streaming.md): a round syncs "
                   "one fragment every H/K steps, and the demo runs K times as many rounds unless --rounds says")
    d.add_argument("--rounds", type=int, default=None, help="rounds to run")
    d.add_argument("--sync-every", type=int, default=None, help="H: inner steps between syncs")
    d.add_argument("--algorithm", default="diloco", choices=["fedavg", "diloco", "fedavgm", "fedadam", "fedyogi"])
    d.add_argument("--summary", type=Path, default=None, help="also write the summary as JSON here")
    d.add_argument("--state-dir", type=Path, default=None, help="run directory (default: a new temp dir)")
    d.add_argument("--config", type=Path, default=None, help="start from this run config instead of the demo's")
    d.add_argument("--keep", action="store_true", help="keep the temp state dir and logs of a finished run")

    s = sub.add_parser("status", help="print a run's state", epilog=profile.PROFILE_HELP)
    _add_client_args(s)
    profile.add_state_dir_arg(s)
    s.add_argument("--json", action="store_true", help="print the raw JSON")
    s.add_argument("--watch", type=cli_admin.watch_interval, default=None, metavar="SECONDS",
                   help="print it again every SECONDS (at least 0.2) until the run finishes (exit 0) or Ctrl+C "
                   "(exit 130)")

    cli_admin.add_config_parser(sub, client_parent)

    e = sub.add_parser("export", help="write the global model as a safetensors file", epilog=profile.EXPORT_HELP)
    src = e.add_mutually_exclusive_group()
    src.add_argument("--coordinator", metavar="URL",
                     help="download from a running coordinator (default $FEDTRAIN_COORDINATOR)")
    src.add_argument("--state-dir", type=Path,
                     help="read a coordinator's state directory on this machine, without asking the coordinator "
                     "(default $FEDTRAIN_STATE_DIR when $FEDTRAIN_COORDINATOR is not set)")
    _add_token_args(e)
    e.add_argument("--ca-cert", default=None, metavar="PEM", help="CA bundle to verify the coordinator's TLS cert")
    e.add_argument("--insecure", action="store_true", help="do not verify TLS certificates (testing only)")
    e.add_argument("--version", type=int, default=None, help="global model version (default: latest)")
    e.add_argument(
        "--out", type=Path, required=True, help="output .safetensors path (a directory with --adapter/--merged)"
    )
    what = e.add_mutually_exclusive_group()
    what.add_argument(
        "--adapter",
        action="store_true",
        help="LoRA runs: the adapter alone as a peft directory (adapter_model.safetensors)",
    )
    what.add_argument(
        "--merged",
        action="store_true",
        help="the whole model with the global weights (LoRA merged into the base): a transformers directory for "
        "hf runs, one .safetensors file for gpt runs",
    )

    r = sub.add_parser("recipes", help="list the shipped recipe configs (use one with --config recipe:NAME)")
    r.add_argument("name", nargs="?", default=None, help="print this recipe's YAML")

    cli_admin.add_rollback_parser(sub, client_parent)
    cli_admin.add_evict_parser(sub, client_parent)
    cli_admin.add_token_parser(sub, client_parent)

    t = sub.add_parser(
        "torchrun",
        help="torchrun in this process, e.g. fedtrain torchrun --nproc_per_node 2 -m fedtrain participant ... "
        "(torchrun's own arguments); a stop ends in one line, not torch's SignalException traceback",
        add_help=False,
    )
    t.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="torchrun's arguments, as torchrun takes them")
    return parser


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
