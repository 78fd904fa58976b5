"""A model of the user's own: examples/custom_model.py federates its MLP, data and eval_fn
against a coordinator started from --init-weights, and `fedtrain config show` of such a run
says what the model is (a custom model: its tensors and parameters), not the GPT defaults."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import fedtrain
from fedtrain.cli import main as fedtrain_main
from fedtrain.config import load_config
from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.tiny import TrainingThread, join_all

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_model.py"


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("custom_model_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_custom_model_example_runs_end_to_end(tmp_path: Path) -> None:
    ex = example()
    init = ex.write_init(tmp_path / "init.safetensors")
    cfg = load_config(EXAMPLE.with_suffix(".yaml")).model_copy(update={"rounds": 4})
    with BackgroundCoordinator(tmp_path / "state", cfg, init_weights=init) as c:
        # site 0 as a user runs it (the script, its own process), site 1 in this process
        env = {**os.environ, "FEDTRAIN_TOKEN": PTOKEN}
        script = subprocess.Popen([sys.executable, str(EXAMPLE), "train", "--coordinator", c.url, "--site", "0"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        here = TrainingThread(ex.train, c.url, PTOKEN, 1).start()
        join_all(here, timeout=120)
        out, err = script.communicate(timeout=120)
        assert script.returncode == 0, err
        assert c.service.finished
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["rounds"] == 4
    history = here.result
    assert len(history) == 4 and "eval_after/accuracy" in history[-1]  # eval_fn's dict reached the records
    # the federated model learned both sites' data: the global model, loaded into the user's module
    out_file = tmp_path / "global.safetensors"
    assert fedtrain_main(["export", "--state-dir", str(tmp_path / "state"), "--out", str(out_file)]) == 0
    net = fedtrain.load_model(out_file, model=ex.Net())
    assert all(torch.equal(p, final[n]) for n, p in net.named_parameters())
    start = fedtrain.load_model(init, model=ex.Net())
    for site in (0, 1, 2):
        x, y = ex.site_data(site, n=300, seed=7)
        evaluate = ex.make_eval_fn(x, y)
        assert evaluate(start)["accuracy"] < 0.7, site  # the initial weights have not learned it
        assert evaluate(net)["accuracy"] > 0.8, site  # chance is 1/3; the centres are apart


def show(url: str, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert fedtrain_main(["config", "show", "--coordinator", url, "--token", PTOKEN]) == 0
    return capsys.readouterr().out


def test_config_show_of_a_custom_model_run_shows_that_model(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    ex = example()
    init = ex.write_init(tmp_path / "mine.safetensors")
    with BackgroundCoordinator(tmp_path / "custom", tiny_config(), init_weights=init) as c:
        text = show(c.url, capsys)
        view = c.service.config_view(None)
    assert "a custom model" in text and "--init-weights mine.safetensors" in text
    assert "n_layer" not in text and "n_embd" not in text and "vocab_size" not in text  # no GPT made up
    n = sum(p.numel() for p in ex.Net().parameters())
    assert "custom: true" in text and "tensors: 6" in text and f"parameters: {n}" in text
    assert view["model"] == {"source": "custom", "init_weights": "mine.safetensors", "tensors": 6,
                             "parameters": n, "dtypes": ["F32"]}
    # a recipe run shows its model section as it is
    with BackgroundCoordinator(tmp_path / "recipe", tiny_config()) as c:
        text = show(c.url, capsys)
    assert "n_layer: 1" in text and "custom" not in text
