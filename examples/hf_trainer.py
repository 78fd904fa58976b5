"""A Hugging Face `Trainer` script that takes part in a fedtrain run: the lines marked
`# fedtrain` are all it takes.

    # a coordinator serving a transformers model (here a tiny GPT-2 on raw bytes):
    fedtrain coordinator --config recipe:hf-gpt2-tiny --state-dir ./run --port 8000
    # then, at each site, with a participant token of its own (./run/participant-tokens/site-1.token, or
    # one from `fedtrain token add NAME --state-dir run`):
    FEDTRAIN_TOKEN=... python examples/hf_trainer.py --coordinator http://HOST:8000 --data stdlib:0/2 --name site-a

The Trainer trains as usual (its optimizer, its schedule, its data collator); every H
optimizer steps the callback syncs the model's trainable parameters with the coordinator
and loads the new global weights, and it stops the Trainer when the run is finished.
Under `torchrun` (the Trainer's DDP) rank 0 talks to the coordinator, the others follow.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import Trainer, TrainingArguments

from fedtrain import CoordinatorClient, RunConfig
from fedtrain.integrations.hf_trainer import FedtrainCallback  # fedtrain
from fedtrain.recipes import TokenStream, build_model, evaluate, load_data, loss_fn, parse_data_spec, tokenizer_of


class Windows(torch.utils.data.Dataset):
    """Causal-LM examples cut from local text (a stand-in for your own dataset)."""

    def __init__(self, stream: TokenStream, n: int) -> None:
        self.x = torch.cat([stream.next_batch()[0] for _ in range(max(1, n // stream.batch_size))])

    def __len__(self) -> int:
        return self.x.size(0)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--token", default=os.environ.get("FEDTRAIN_TOKEN"))
    ap.add_argument("--data", default="stdlib:0/2", help="a file, a directory or stdlib:K/N")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default="hf-trainer-out")
    args = ap.parse_args()

    # The model must match the run's (same trainable parameter names, shapes, dtypes): here it is
    # built from the run's own recipe config; an existing script would load its model as it always has.
    cfg = RunConfig.model_validate(CoordinatorClient(args.coordinator, args.token).get_config()["config"])
    model = build_model(cfg.model, seed=cfg.seed)
    tokens = load_data(cfg.model, parse_data_spec(args.data), tokenizer_of(cfg.model))
    stream = TokenStream(tokens, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=0)

    def eval_fn(m: torch.nn.Module) -> float:  # held-out loss, before and after every sync
        return evaluate(m, stream.eval_batches(cfg.train.eval_batches), loss_fn(cfg.model))

    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=args.out,
            max_steps=1_000_000,  # the run decides when training ends
            per_device_train_batch_size=cfg.train.batch_size,
            learning_rate=cfg.train.lr,
            logging_steps=10,
            save_strategy="no",
            report_to="none",
            include_num_input_tokens_seen="all",  # contributions are weighted by tokens
        ),
        train_dataset=Windows(stream, n=4096),
        callbacks=[FedtrainCallback(args.coordinator, token=args.token, name=args.name, eval_fn=eval_fn)],  # fedtrain
    )
    trainer.train()


if __name__ == "__main__":
    main()
