"""The `fedtrain` command: coordinator | participant | demo | status | export.

Every command turns fedtrain errors into one line on stderr and exit status 2 (never a
traceback), and Ctrl+C into a clean stop with status 130.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from fedtrain.errors import FedtrainError

DEFAULT_PORT = 8000


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", required=True, metavar="URL", help="coordinator URL, e.g. http://HOST:8000")
    p.add_argument("--token", default=None, help="bearer token (default: $FEDTRAIN_TOKEN, else $FEDTRAIN_ADMIN_TOKEN)")
    p.add_argument("--ca-cert", default=None, metavar="PEM", help="CA bundle to verify the coordinator's TLS cert")
    p.add_argument("--insecure", action="store_true", help="do not verify TLS certificates (testing only)")


def _token(args: argparse.Namespace) -> str:
    token = (
        args.token
        or os.environ.get("FEDTRAIN_TOKEN", "").split(",")[0].strip()
        or os.environ.get("FEDTRAIN_ADMIN_TOKEN")
    )
    if not token:
        raise FedtrainError("no token: pass --token or set FEDTRAIN_TOKEN")
    return token


def _verify(args: argparse.Namespace) -> bool | str:
    if args.insecure:
        return False
    return args.ca_cert or True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedtrain", description="Fault-tolerant federated and DiLoCo training for PyTorch."
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
        help="participant token (repeatable; default $FEDTRAIN_TOKEN, comma-separated)",
    )
    c.add_argument("--admin-token", default=None, help="admin token (default $FEDTRAIN_ADMIN_TOKEN)")
    c.add_argument("--init-weights", type=Path, default=None, help="initial global weights (.safetensors)")
    c.add_argument("--tls-cert", type=Path, default=None, help="TLS certificate (PEM)")
    c.add_argument("--tls-key", type=Path, default=None, help="TLS private key (PEM)")

    p = sub.add_parser(
        "participant",
        help="train the run's recipe on local data and sync with a coordinator "
        "(also under torchrun --nproc_per_node N -m fedtrain participant ...)",
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

    d = sub.add_parser("demo", help="a coordinator and N participants on this machine, then a summary")
    d.add_argument("--participants", type=int, default=4, help="number of participants (default 4)")
    d.add_argument("--rounds", type=int, default=None, help="rounds to run")
    d.add_argument("--sync-every", type=int, default=None, help="H: inner steps between syncs")
    d.add_argument("--algorithm", default="diloco", choices=["fedavg", "diloco", "fedavgm", "fedadam", "fedyogi"])
    d.add_argument("--summary", type=Path, default=None, help="also write the summary as JSON here")
    d.add_argument("--state-dir", type=Path, default=None, help="run directory (default: a new temp dir)")
    d.add_argument("--config", type=Path, default=None, help="start from this run config instead of the demo's")

    s = sub.add_parser("status", help="print a run's state")
    _add_client_args(s)
    s.add_argument("--json", action="store_true", help="print the raw JSON")

    e = sub.add_parser("export", help="write the global model as a safetensors file")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--coordinator", metavar="URL", help="download from a running coordinator")
    src.add_argument("--state-dir", type=Path, help="read a coordinator's state directory")
    e.add_argument("--token", default=None, help="bearer token (with --coordinator)")
    e.add_argument("--ca-cert", default=None)
    e.add_argument("--insecure", action="store_true")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where a shell started us ignoring it
    try:
        from fedtrain import faults

        faults.arm_from_env()  # FEDTRAIN_FAULTS: crash this process at a named point (tests, chaos runs)
        return int(COMMANDS[args.command](args) or 0)
    except FedtrainError as e:
        print(f"fedtrain {args.command}: error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fedtrain {args.command}: stopped", file=sys.stderr)
        return 130


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def cmd_coordinator(args: argparse.Namespace) -> int:
    from fedtrain.coordinator.runner import run_coordinator

    return run_coordinator(args)


def cmd_participant(args: argparse.Namespace) -> int:
    from fedtrain.participant.client import RetryPolicy
    from fedtrain.recipes.train import run_participant

    result = run_participant(
        args.coordinator,
        _token(args),
        args.data,
        name=args.name,
        threads=args.threads,
        verify=_verify(args),
        retry=RetryPolicy(max_elapsed_s=args.give_up_after),
        run_dir=args.run_dir,
        device=args.device,
    )
    print(json.dumps(result))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fedtrain.demo import run_demo

    return run_demo(args)


def cmd_status(args: argparse.Namespace) -> int:
    from fedtrain.participant.client import CoordinatorClient, RetryPolicy
    from fedtrain.report import eval_rows, format_status

    with CoordinatorClient(
        args.coordinator, _token(args), verify=_verify(args), retry=RetryPolicy(max_elapsed_s=5)
    ) as client:
        status = client.status()
        status["evals"] = eval_rows(client.metrics())
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from fedtrain.export import export_model

    version, n, digest = export_model(args)
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
    "export": cmd_export,
    "recipes": cmd_recipes,
}

if __name__ == "__main__":
    sys.exit(main())
