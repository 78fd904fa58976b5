"""A Hugging Face `Trainer` federated by `FedtrainCallback`: it syncs every H steps and stops with the run."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.recipes import TokenStream, build_model, evaluate, load_tokens, loss_fn, parse_data_spec
from tests.helpers.config import PTOKEN, tiny_config

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64, "vocab_size": 256}


class Windows(torch.utils.data.Dataset):
    """Causal-LM examples (input_ids, labels) cut from local text."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, n: int) -> None:
        self.stream = TokenStream(tokens, batch_size=n, seq_len=seq_len, seed=0)
        self.x, _ = self.stream.next_batch()

    def __len__(self) -> int:
        return self.x.size(0)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def test_trainer_script_federates_with_a_callback(tmp_path: Path) -> None:
    # here, not at the top: transformers takes ~3 s of CPU to import, in each xdist worker that collects this
    from transformers import Trainer, TrainingArguments

    from fedtrain.integrations.hf_trainer import FedtrainCallback

    cfg = tiny_config(model={"recipe": "hf", "hf": {"config": GPT2}}, rounds=2, train={"sync_every": 3})
    data = Windows(load_tokens(parse_data_spec("stdlib:0/4")), seq_len=32, n=64)
    model = build_model(cfg.model, seed=123)  # the user's model: its weights are replaced by the global ones

    def eval_fn(m: torch.nn.Module) -> float:
        return evaluate(m, data.stream.eval_batches(2), loss_fn(cfg.model))

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=100,  # the run ends first: 2 rounds of 3 steps
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        include_num_input_tokens_seen="all",
    )
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        callback = FedtrainCallback(c.url, token=PTOKEN, name="trainer", eval_fn=eval_fn, run_dir=tmp_path / "run")
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        trainer.train()
        assert c.service.finished and c.service.version == 2
        assert trainer.state.global_step == 6
        rounds = c.service.round_history()
        final = c.service.inspect().weights
        assert all(torch.equal(p.detach(), final[n]) for n, p in model.named_parameters() if p.requires_grad)
        names = {m["name"] for m in c.service.metrics()}
    assert [r["submissions"][0]["tokens"] for r in rounds] == [3 * 4 * 32] * 2  # tokens counted by the Trainer
    assert {"eval_before/loss", "eval_after/loss", "train_loss"} <= names
    fed = callback.participant
    assert fed is not None and [h["round"] for h in fed.history] == [0, 1]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [0, 1]
