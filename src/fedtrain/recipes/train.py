"""The built-in recipe's participant: a byte-level GPT trained on local text, synced by fedtrain.

A short, readable loop on the public API only (`Participant`, the recipe's model and data):
copy it to start a training script of your own.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import torch

from fedtrain.config import RunConfig
from fedtrain.participant import CoordinatorClient, Participant, RetryPolicy
from fedtrain.recipes.data import TokenStream, evaluate, load_tokens, parse_data_spec
from fedtrain.recipes.gpt import build_model

log = logging.getLogger("fedtrain.recipe")


def _seed_of(name: str | None) -> int:
    return int.from_bytes(hashlib.blake2b((name or "anon").encode(), digest_size=4).digest(), "little")


def run_participant(
    url: str,
    token: str,
    data: str,
    *,
    name: str | None = None,
    threads: int = 1,
    verify: bool | str = True,
    max_steps: int | None = None,
    retry: RetryPolicy = RetryPolicy(),
) -> dict[str, Any]:
    """Join the run at `url`, train on `data` until the run finishes; returns a summary."""
    torch.set_num_threads(threads)
    tokens = load_tokens(parse_data_spec(data))  # bad data fails here, before any network call
    client = CoordinatorClient(url, token, verify=verify, retry=retry)
    cfg = RunConfig.model_validate(client.get_config()["config"])
    stream = TokenStream(tokens, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=_seed_of(name))
    model = build_model(cfg.model, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)

    def eval_fn(m: torch.nn.Module) -> float:
        return evaluate(m, stream.eval_batches(cfg.train.eval_batches))

    log.info("%s: %d training tokens from %s", name or "participant", tokens.numel(), data)
    t0 = time.perf_counter()
    with Participant(client, model=model, inner_optimizer=opt, eval_fn=eval_fn, name=name) as fed:
        while not fed.finished and (max_steps is None or fed.steps < max_steps):
            stream.batch_size = fed.config.train.batch_size  # live: changes apply at round boundaries
            x, y = stream.next_batch()
            _, loss = model(x, y)
            loss.backward()
            if cfg.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if fed.step(tokens=x.numel(), loss=loss.item()):
                h = fed.history[-1]
                log.info(
                    "round %d: train loss %.3f, eval %.3f -> %.3f, sync %.2fs",
                    h["round"],
                    h.get("train_loss", float("nan")),
                    h.get("eval_before/loss", float("nan")),
                    h.get("eval_after/loss", float("nan")),
                    h["sync_s"],
                )
        return {
            "participant": fed.participant_id,
            "steps": fed.steps,
            "tokens": fed.tokens,
            "rounds": len(fed.history),
            "bytes_up": fed.bytes_up,
            "bytes_down": fed.bytes_down,
            "wall_s": round(time.perf_counter() - t0, 2),
            "sync_s": round(fed.sync_seconds, 2),
            "final_round": fed.round,
        }
