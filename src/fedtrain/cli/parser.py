"""The `fedtrain` command line: every command's arguments, their help texts and their checks
(`build_parser`). It imports only the standard library and fedtrain's light modules, so that
`fedtrain --help` stays fast; `commands` runs what it parses.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import fedtrain
import fedtrain.cli.admin_commands as cli_admin
import fedtrain.cli.profile as profile

DEFAULT_PORT = 8000

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
    d.add_argument("--compression", default=None, choices=["none", "bf16", "int8", "e3m0", "int2", "ternary", "int1"],
                   help="train.compression of uploads and, but for bf16, of downloads (download_compression), "
                   "with the config's block, fp32 scales and plain codes; default: the recommended preset both ways "
                   "(int2, a bf16 scale per 64 values, deflated; docs/quality.md), the config's with --config")
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
