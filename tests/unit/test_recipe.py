"""Unit tests of the built-in recipe: the GPT model and the offline stdlib data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fedtrain.config import ModelConfig
from fedtrain.errors import ConfigError
from fedtrain.recipes import (
    GPT,
    TokenStream,
    build_model,
    count_parameters,
    evaluate,
    heldout_paths,
    load_tokens,
    parse_data_spec,
    stdlib_root,
    stdlib_shards,
)

TINY = ModelConfig.model_validate({"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32})


def _sync_set(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------- model


def test_build_model_is_deterministic_and_seeded() -> None:
    rng_before = torch.random.get_rng_state()
    a, b = build_model(TINY, seed=3), build_model(TINY, seed=3)
    assert torch.equal(rng_before, torch.random.get_rng_state()), "global RNG must not be used"
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c = build_model(TINY, seed=4)
    assert not torch.equal(sa["wte.weight"], c.state_dict()["wte.weight"])
    assert all(p.dtype == torch.float32 for p in a.parameters())


def test_build_model_ignores_global_rng_and_default_dtype() -> None:
    ref = build_model(TINY, seed=0).state_dict()
    torch.manual_seed(1234)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        other = build_model(TINY, seed=0).state_dict()
    finally:
        torch.set_default_dtype(old)
    assert all(other[k].dtype == torch.float32 and torch.equal(ref[k], other[k]) for k in ref)


def test_weight_tying_keeps_state_dict_and_sync_set_consistent() -> None:
    model = build_model(TINY, seed=0)
    sync = _sync_set(model)
    assert list(sync) == list(model.state_dict())
    assert count_parameters(model) == sum(p.numel() for p in sync.values())
    # A dict with the sync-set names loads back strictly into a fresh model.
    other = build_model(TINY, seed=1)
    other.load_state_dict({k: v.detach().clone() for k, v in sync.items()}, strict=True)
    x = torch.randint(0, 256, (2, 8))
    assert torch.equal(model(x)[0], other(x)[0])
    # The head is tied: changing the embedding changes the logits of every position.
    with torch.no_grad():
        other.wte.weight.add_(1.0)
    assert not torch.equal(model(x)[0], other(x)[0])


def test_forward_shapes_and_initial_loss() -> None:
    model = build_model(TINY, seed=0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 32), generator=gen)
    y = torch.randint(0, 256, (4, 32), generator=gen)
    logits, loss = model(x, y)
    assert logits.shape == (4, 32, 256)
    assert loss is not None and loss.shape == ()
    assert abs(loss.item() - math.log(256)) < 0.15
    logits2, none = model(x)
    assert none is None and torch.equal(logits, logits2)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_adamw_lowers_the_loss_on_a_tiny_corpus() -> None:
    tokens = torch.frombuffer(bytearray(b"def add(a, b):\n    return a + b\n" * 40), dtype=torch.uint8)
    stream = TokenStream(tokens, batch_size=8, seq_len=32, seed=0, heldout_fraction=0.0)
    model = build_model(TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = stream.next_batch()
    first = model(x, y)[1]
    assert first is not None
    for _ in range(30):
        _, loss = model(*stream.next_batch())
        assert loss is not None
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first.item() - 1.5


def test_gpt_is_an_nn_module_with_config() -> None:
    model = build_model(TINY)
    assert isinstance(model, GPT) and model.config == TINY


# ----------------------------------------------------------------------------- shards


def test_stdlib_shards_are_disjoint_nonempty_deterministic_and_exclude_heldout() -> None:
    shards = stdlib_shards(4)
    assert len(shards) == 4 and shards == stdlib_shards(4)
    sets = [set(s) for s in shards]
    assert all(sets) and sum(len(s) for s in sets) == len(set().union(*sets))
    held = set(heldout_paths())
    assert held and not held & set().union(*sets)
    sizes = [sum(p.stat().st_size for p in s) for s in shards]
    assert max(sizes) < 1.5 * min(sizes)
    root = stdlib_root()
    for p in set().union(*sets):
        parts = p.relative_to(root).parts
        assert p.suffix == ".py" and p.stat().st_size <= 1_000_000
        assert not {"test", "tests", "__pycache__", "site-packages"} & set(parts)


def test_stdlib_shards_split_by_package() -> None:
    root = stdlib_root()
    owner: dict[str, set[int]] = {}
    for k, shard in enumerate(stdlib_shards(3)):
        for p in shard:
            parts = p.relative_to(root).parts
            if len(parts) > 1:
                owner.setdefault(parts[0], set()).add(k)
    assert owner and all(len(ks) == 1 for ks in owner.values())


def test_heldout_is_a_few_hundred_kb() -> None:
    size = sum(p.stat().st_size for p in heldout_paths())
    assert 100_000 < size < 1_000_000


@pytest.mark.parametrize("n", [0, -1, 10_000])
def test_stdlib_shards_refuses_bad_n(n: int) -> None:
    with pytest.raises(ConfigError, match="shards"):
        stdlib_shards(n)


# ----------------------------------------------------------------------------- tokens


def test_load_tokens_reads_files_and_directories(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("ab\n")
    (tmp_path / "sub" / "b.md").write_text("é")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    tokens = load_tokens(tmp_path)
    assert tokens.dtype == torch.uint8
    assert bytes(tokens.tolist()) == b"ab\n" + "é".encode() + b"\n"
    assert bytes(load_tokens([tmp_path / "a.py"]).tolist()) == b"ab\n"
    assert bytes(load_tokens(str(tmp_path / "a.py")).tolist()) == b"ab\n"


def test_load_tokens_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(ConfigError, match="nope.txt"):
        load_tokens(missing)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="empty.txt"):
        load_tokens(tmp_path / "empty.txt")
    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match="d"):
        load_tokens(tmp_path / "d")


# ----------------------------------------------------------------------------- stream


def _tokens(n: int = 5000) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)


def test_token_stream_batches_are_shifted_windows_and_deterministic() -> None:
    tokens = _tokens()
    a = TokenStream(tokens, batch_size=4, seq_len=16, seed=7)
    b = TokenStream(tokens, batch_size=4, seq_len=16, seed=7)
    x, y = a.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, b.next_batch()[0])
    assert not torch.equal(a.next_batch()[0], TokenStream(tokens, batch_size=4, seq_len=16, seed=8).next_batch()[0])
    assert a.position == 2


def test_token_stream_never_draws_from_the_heldout_slice() -> None:
    tokens = torch.cat([torch.zeros(950, dtype=torch.uint8), torch.full((50,), 9, dtype=torch.uint8)])
    stream = TokenStream(tokens, batch_size=16, seq_len=8, seed=0, heldout_fraction=0.05)
    for _ in range(50):
        x, y = stream.next_batch()
        assert int(x.max()) == 0 and int(y.max()) == 0
    x, _ = next(stream.eval_batches(1))
    assert int(x.min()) == 9


def test_token_stream_resume_through_json() -> None:
    tokens = _tokens()
    a = TokenStream(tokens, batch_size=4, seq_len=16, seed=3)
    for _ in range(5):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    b = TokenStream(tokens, batch_size=4, seq_len=16, seed=999)
    b.load_state_dict(state)
    assert b.position == 5
    for _ in range(3):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    with pytest.raises(ConfigError):
        b.load_state_dict({"seed": 1})
    with pytest.raises(ConfigError):
        b.load_state_dict({"seed": 1, "batches": "x"})


def test_eval_batches_are_fixed() -> None:
    stream = TokenStream(_tokens(), batch_size=4, seq_len=16, seed=0)
    first = list(stream.eval_batches(3))
    stream.next_batch()
    again = list(stream.eval_batches(3))
    assert len(first) == 3 and all(x.shape == (4, 16) for x, _ in first)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))


def test_token_stream_rejects_short_corpora() -> None:
    with pytest.raises(ConfigError, match="seq_len"):
        TokenStream(_tokens(16), batch_size=1, seq_len=16, seed=0)
    with pytest.raises(ConfigError, match="held-out"):
        TokenStream(_tokens(20), batch_size=1, seq_len=16, seed=0)
    TokenStream(_tokens(17), batch_size=1, seq_len=16, seed=0, heldout_fraction=0.0).next_batch()


def test_evaluate_restores_mode_and_matches_manual_mean() -> None:
    model = build_model(TINY, seed=0)
    batches = list(TokenStream(_tokens(), batch_size=2, seq_len=16, seed=0).eval_batches(2))
    model.train()
    value = evaluate(model, batches)
    assert model.training
    with torch.no_grad():
        manual = sum(model(x, y)[1].item() for x, y in batches) / 2  # type: ignore[union-attr]
    assert value == pytest.approx(manual, rel=1e-6)
    model.eval()
    evaluate(model, batches)
    assert not model.training


# ----------------------------------------------------------------------------- specs


def test_parse_data_spec_variants(tmp_path: Path) -> None:
    assert parse_data_spec("stdlib:1/4") == stdlib_shards(4)[1]
    assert parse_data_spec("stdlib:heldout") == heldout_paths()
    assert parse_data_spec(str(tmp_path)) == [tmp_path]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("stdlib:4/4", "0..3"),
        ("stdlib:x/4", "stdlib:K/N"),
        ("stdlib:1", "stdlib:K/N"),
        ("stdlib:0/0", "0"),
        ("", "empty"),
        ("/no/such/dir", "/no/such/dir"),
    ],
)
def test_parse_data_spec_errors(spec: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_data_spec(spec)


def test_warmup_raises_the_lr_linearly_then_leaves_it_to_the_config() -> None:
    from fedtrain.config import TrainConfig
    from fedtrain.recipes.train import warm_up

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    train = TrainConfig(lr=0.01, warmup_steps=4)
    lrs = []
    for done in range(7):
        warm_up(opt, done, train)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01, 0.01])
    opt.param_groups[0]["lr"] = 0.02  # a live change of train.lr after the warmup is kept
    warm_up(opt, 10, train)
    assert opt.param_groups[0]["lr"] == 0.02
    none = TrainConfig(lr=0.01)  # warmup_steps 0: the lr as configured from the first step
    warm_up(opt, 0, none)
    assert opt.param_groups[0]["lr"] == 0.01
