"""Measure the GPT recipe on this CPU: parameters, seconds per AdamW step, loss after N steps.

Used to choose the demo defaults (model size, batch size, sequence length, steps). Each
size trains from the same seed on stdlib shard 0 of 4 with one thread, as one demo
participant does, and reports the training loss (mean of the last 10 steps) and the loss
on the fixed stdlib held-out set.

    python benchmarks/step_time.py                       # default sizes, 100 steps
    python benchmarks/step_time.py --sizes 4x128 --steps 300 --lr 3e-3
"""

from __future__ import annotations

import argparse
import time

import torch

from fedtrain.config import ModelConfig
from fedtrain.recipes import (
    TokenStream,
    build_model,
    count_parameters,
    evaluate,
    heldout_paths,
    load_tokens,
    stdlib_shards,
)


def _size(text: str) -> tuple[int, int]:
    n_layer, n_embd = text.lower().split("x")
    return int(n_layer), int(n_embd)


def bench(n_layer: int, n_embd: int, *, steps: int, batch_size: int, seq_len: int, lr: float) -> dict[str, float]:
    shape = {"n_layer": n_layer, "n_embd": n_embd, "n_head": max(1, n_embd // 32)}
    cfg = ModelConfig.model_validate({**shape, "block_size": seq_len})
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    stream = TokenStream(load_tokens(stdlib_shards(4)[0]), batch_size=batch_size, seq_len=seq_len, seed=0)
    heldout = TokenStream(
        load_tokens(heldout_paths()),
        batch_size=batch_size,
        seq_len=seq_len,
        seed=0,
        heldout_fraction=0.5,
    )
    init_eval = evaluate(model, heldout.eval_batches(4))
    losses, times = [], []
    for _ in range(steps):
        x, y = stream.next_batch()
        t0 = time.perf_counter()
        _, loss = model(x, y)
        assert loss is not None
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    steady = sorted(times[5:] or times)
    return {
        "params": count_parameters(model),
        "s_per_step": steady[len(steady) // 2],
        "loss0": losses[0],
        "loss_end": sum(losses[-10:]) / len(losses[-10:]),
        "eval0": init_eval,
        "eval_end": evaluate(model, heldout.eval_batches(4)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["2x64", "2x128", "4x128", "4x192"], help="LAYERSxWIDTH")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"batch_size={args.batch_size} seq_len={args.seq_len} steps={args.steps} lr={args.lr} "
        f"threads={args.threads} torch={torch.__version__}"
    )
    print(f"{'size':>7} {'params':>9} {'s/step':>7} {'loss@1':>7} {'loss@end':>8} {'eval@0':>7} {'eval@end':>8}")
    for text in args.sizes:
        n_layer, n_embd = _size(text)
        r = bench(
            n_layer,
            n_embd,
            steps=args.steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            lr=args.lr,
        )
        print(
            f"{text:>7} {r['params']:>9,} {r['s_per_step']:>7.3f} {r['loss0']:>7.3f} "
            f"{r['loss_end']:>8.3f} {r['eval0']:>7.3f} {r['eval_end']:>8.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
