"""LoRA over the wire: only adapter bytes travel and are stored; export of the adapter or the merged model."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from fedtrain.cli import main as fedtrain_main
from fedtrain.config import RunConfig
from fedtrain.coordinator import BackgroundCoordinator
from fedtrain.recipes import build_model, load_model
from fedtrain.wire import EncodedBody, iter_file, read_tensors
from tests.helpers.config import PTOKEN, tiny_config
from tests.helpers.runs import LLAMA, run_two


def lora_config(**overrides: object) -> RunConfig:
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    model = {"recipe": "hf", "hf": {"config": LLAMA}, "lora": lora}
    return tiny_config(model=model, rounds=2, train={"sync_every": 3, "lr": 1e-2}, min_participants=2, **overrides)


def test_only_adapters_travel_and_are_stored(tmp_path: Path) -> None:
    cfg = lora_config()
    full = build_model(cfg.model, seed=cfg.seed)
    adapters = {n: p.detach() for n, p in full.named_parameters() if p.requires_grad}
    everything = {n: p.detach() for n, p in full.named_parameters()}
    adapter_body = EncodedBody(adapters).content_length
    full_body = EncodedBody(everything).content_length
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        assert set(c.service.inspect().weights) == set(adapters)  # the coordinator holds and merges adapters only
        results = run_two(c.url, tmp_path)
        status = c.service.status()
        rounds = c.service.round_history()
        assert c.service.finished
    assert status["model_bytes"] == adapter_bytes
    for r in results.values():
        assert r["rounds"] == 2
        assert r["bytes_up"] == 2 * adapter_body  # every upload is exactly the adapters' safetensors body
        assert r["bytes_up_per_round"] == adapter_body
    assert all(s["bytes"] == adapter_body for r in rounds for s in r["submissions"])
    # the frozen base never travels: a full-model body would be this much larger
    assert full_body > 10 * adapter_body, (full_body, adapter_body)
    stored = dict(read_tensors(iter_file(tmp_path / "state" / "checkpoints" / "global-000002.safetensors")))
    assert set(stored) == set(adapters)
    # each participant ends on the global adapters
    final = c.service.inspect().weights
    for i in range(2):
        mine = dict(read_tensors(iter_file(tmp_path / f"p{i}" / "final.safetensors")))
        assert all(torch.equal(mine[n], final[n]) for n in final)


def test_export_adapter_and_merged(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = lora_config()
    with BackgroundCoordinator(tmp_path / "state", cfg) as c:
        run_two(c.url, tmp_path)
        final = {k: v.clone() for k, v in c.service.inspect().weights.items()}
    state = str(tmp_path / "state")
    assert fedtrain_main(["export", "--state-dir", state, "--adapter", "--out", str(tmp_path / "adapter")]) == 0
    assert fedtrain_main(["export", "--state-dir", state, "--merged", "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()

    ours = build_model(cfg.model, seed=cfg.seed)  # base + adapters with the global adapter weights
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if p.requires_grad:
                p.copy_(final[n])
    x = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        want = ours(input_ids=x).logits
        base = build_model(cfg.model.model_copy(update={"lora": None}), seed=cfg.seed)
        loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
        assert torch.allclose(loaded(input_ids=x).logits, want, atol=1e-5)
        assert torch.allclose(merged(input_ids=x).logits, want, atol=1e-4)
        # fedtrain.load_model: the transformers directory, and the adapter on its base rebuilt from the run's seed
        assert torch.allclose(load_model(tmp_path / "merged")(input_ids=x).logits, want, atol=1e-4)
        assert torch.allclose(load_model(tmp_path / "adapter")(input_ids=x).logits, want, atol=1e-5)
        bare = tmp_path / "adapters.safetensors"  # the sync set as stored: the base comes from the run's seed
        assert fedtrain_main(["export", "--state-dir", state, "--out", str(bare)]) == 0
        assert torch.allclose(load_model(bare)(input_ids=x).logits, want, atol=1e-6)
        plain = build_model(cfg.model.model_copy(update={"lora": None}), seed=cfg.seed)  # (peft wrapped `base`)
        assert not torch.allclose(plain(input_ids=x).logits, want, atol=1e-4)  # the adapters did change the model
    assert not any("lora" in n for n, _ in merged.named_parameters())


def test_participant_with_another_frozen_base_is_refused(tmp_path: Path) -> None:
    import httpx

    from fedtrain.recipes import base_fingerprint

    cfg = lora_config()
    right = base_fingerprint(build_model(cfg.model, seed=cfg.seed))
    wrong = base_fingerprint(build_model(cfg.model, seed=cfg.seed + 1))
    assert right != wrong
    with BackgroundCoordinator(tmp_path / "s", cfg) as c:
        with httpx.Client(base_url=c.url, headers={"Authorization": f"Bearer {PTOKEN}"}) as http:
            r = http.post("/v1/join", json={"name": "odd", "info": {"base": wrong}})
            assert r.status_code == 409 and r.json()["error"]["code"] == "base_mismatch", r.text
            assert "frozen base" in r.json()["error"]["message"]
            assert http.post("/v1/join", json={"name": "good", "info": {"base": right}}).status_code == 200


def test_models_built_on_several_threads_at_once_are_identical() -> None:
    from fedtrain.recipes import base_fingerprint

    cfg = lora_config()
    prints: list[str] = []

    def build() -> None:
        model = build_model(cfg.model, seed=cfg.seed)
        prints.append(base_fingerprint(model) + str(float(sum(p.sum() for p in model.parameters() if p.requires_grad))))

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(prints) == 4 and len(set(prints)) == 1, prints
