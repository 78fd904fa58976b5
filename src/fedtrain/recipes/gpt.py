"""The built-in model recipe: a small nanoGPT-style byte-level causal language model.

Owns the architecture (`GPT`), its deterministic construction (`build_model`) and
`count_parameters`. The model is deliberately plain so that it is easy to read and copy:
token + learned position embeddings, pre-LayerNorm blocks with causal self-attention
(`scaled_dot_product_attention(is_causal=True)`) and a 4x GELU MLP, a final LayerNorm
and an LM head tied to the token embedding.

Weight tying is done functionally (`F.linear(h, wte.weight)`), not by sharing one
Parameter between two modules. That keeps `state_dict()` and `named_parameters()` on
exactly the same keys, so the sync set `{name: p for name, p in model.named_parameters()}`
loads back with `load_state_dict(strict=True)` and can be saved by safetensors (which
refuses two names for one storage).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fedtrain.config import ModelConfig

__all__ = ["GPT", "build_model", "count_parameters"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention over the whole (B, T, C) sequence."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(4x) -> GELU -> Linear."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; `forward(idx, targets)` returns `(logits, loss or None)`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: LongTensor[B, T] with T <= block_size. Loss is the mean cross-entropy."""
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds the model's block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        # The LM head is tied to the token embedding (see the module docstring).
        logits = F.linear(self.ln_f(x), self.wte.weight)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def _init_weights(model: GPT, generator: torch.Generator) -> None:
    """nanoGPT initialisation, drawn from `generator` in named_parameters order."""
    std = 0.02
    proj_std = std / math.sqrt(2 * model.config.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                s = proj_std if name.endswith("c_proj.weight") else std
                nn.init.normal_(p, mean=0.0, std=s, generator=generator)


def build_model(cfg: ModelConfig, seed: int = 0) -> GPT:
    """Build the GPT of `cfg` with float32 weights that depend only on (cfg, seed).

    Modules are created on the meta device so that the default initialisers never touch
    (or advance) the global RNG; every value is then drawn from a local generator.
    """
    with torch.device("meta"):
        model = GPT(cfg)
    model = model.to_empty(device="cpu").to(torch.float32)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    _init_weights(model, generator)
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (a tied weight is counted once)."""
    return sum(p.numel() for p in model.parameters())
