"""Federate a model of your own: any nn.Module, your data, your loss and your eval_fn.

fedtrain needs nothing of the model but its trainable parameters (the sync set): the
coordinator starts from a safetensors file of them (`--init-weights`) and the participants
join with the same module. Here the model is a small MLP that classifies 2-D points into
three classes, and each site has data of its own (its own mix of the classes: non-IID).

    # 1. the initial weights, once (any site's module would do: the coordinator hands them out)
    python examples/custom_model.py init --out init.safetensors
    # 2. a coordinator serving them (the run config says rounds, H and the outer optimizer)
    fedtrain coordinator --init-weights init.safetensors --config examples/custom_model.yaml \\
        --state-dir custom-run --port 8000
    # 3. each site, with a participant token of its own: custom-run/participant-tokens/site-1.token, which
    # the coordinator minted at its first start, or one from `fedtrain token add site-b --state-dir custom-run`
    FEDTRAIN_TOKEN=... python examples/custom_model.py train --coordinator http://127.0.0.1:8000 --site 0
    FEDTRAIN_TOKEN=... python examples/custom_model.py train --coordinator http://127.0.0.1:8000 --site 1
    # 4. the global model, back in your module
    fedtrain export --state-dir custom-run --out global.safetensors
    python -c "import fedtrain, custom_model; fedtrain.load_model('global.safetensors', model=custom_model.Net())"

The training loop is an ordinary PyTorch loop; the lines marked `# fedtrain` are what joins it
to the run. `fed.step` syncs every H steps (H from the run config) and calls `eval_fn`
before the upload and after the new global weights are loaded.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from fedtrain import Participant  # fedtrain

CENTRES = torch.tensor([[0.0, 2.0], [-2.0, -1.0], [2.0, -1.0]])


class Net(nn.Module):
    """Your model: here 2 -> 32 -> 3, a classifier of 2-D points."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def site_data(site: int, n: int = 600, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Site `site`'s points and labels: noisy blobs around three centres, with this site seeing
    mostly one class (60%) and the rest split evenly: every site's data differs."""
    g = torch.Generator().manual_seed(1000 * site + seed)
    weights = torch.full((3,), 0.2)
    weights[site % 3] = 0.6
    y = torch.multinomial(weights, n, replacement=True, generator=g)
    x = CENTRES[y] + 1.1 * torch.randn(n, 2, generator=g)
    return x, y


def make_eval_fn(x: torch.Tensor, y: torch.Tensor) -> Callable[[nn.Module], dict[str, float]]:
    """An `eval_fn`: called with the model, returns a float (reported as "loss") or a dict of
    named floats. It runs in the middle of training: switch to eval mode and back yourself."""

    def eval_fn(model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(x)
            loss = F.cross_entropy(logits, y).item()
            accuracy = (logits.argmax(dim=1) == y).float().mean().item()
        model.train(was_training)
        return {"loss": loss, "accuracy": accuracy}

    return eval_fn


def write_init(out: Path, seed: int = 0) -> Path:
    """The coordinator's --init-weights: the trainable parameters of a fresh `Net`."""
    torch.manual_seed(seed)
    model = Net()
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}, str(out))
    return out


def train(coordinator: str, token: str, site: int, *, batch_size: int = 32, lr: float = 3e-3,
          name: str | None = None) -> list[dict]:
    """Train site `site` until the run is finished; returns the per-round history."""
    x, y = site_data(site)
    x_eval, y_eval = site_data(site, n=300, seed=1)  # held out: the same site, other points
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(site)
    with Participant(coordinator, token=token, model=model, inner_optimizer=opt,  # fedtrain
                     eval_fn=make_eval_fn(x_eval, y_eval), name=name or f"site-{site}") as fed:
        while not fed.finished:  # fedtrain: the run says when it ends
            idx = torch.randint(0, x.size(0), (batch_size,), generator=g)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            fed.step(tokens=batch_size, loss=loss.item())  # fedtrain: counts, and syncs every H steps
        return fed.history


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    i = sub.add_parser("init", help="write the initial weights for `fedtrain coordinator --init-weights`")
    i.add_argument("--out", type=Path, default=Path("init.safetensors"))
    t = sub.add_parser("train", help="train one site until the run is finished")
    t.add_argument("--coordinator", required=True, metavar="URL")
    t.add_argument("--token", default=os.environ.get("FEDTRAIN_TOKEN"), help="default: $FEDTRAIN_TOKEN")
    t.add_argument("--site", type=int, default=0, help="which site's data (0, 1, 2, ...)")
    args = ap.parse_args()
    if args.command == "init":
        print(f"wrote {write_init(args.out)}")
        return
    if not args.token:
        ap.error("no token: pass --token or set FEDTRAIN_TOKEN")
    history = train(args.coordinator, args.token, args.site)
    first, last = history[0], history[-1]
    print(json.dumps({"rounds": len(history), "accuracy_before": first.get("eval_before/accuracy"),
                      "accuracy_after": last.get("eval_after/accuracy")}))


if __name__ == "__main__":
    main()
