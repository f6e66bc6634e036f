"""A small character-level GPT as an ``nn.Sequential``, its data, and sampling.

The model is ``Sequential(Embed, Block, ..., Block, Head)``; fzero's ZeRO-3
shards it one ``Block`` at a time (``units=(Block,)``):

* :class:`Embed`: token embedding + learned positional embedding,
  ``int64 [B, T] -> [B, T, d]``;
* :class:`Block`: pre-LayerNorm causal self-attention
  (``F.scaled_dot_product_attention(is_causal=True)``) and a GELU MLP, each
  with a residual connection;
* :class:`Head`: final LayerNorm and a linear map to the vocabulary.

No buffers and no in-place tricks, so ``torch.func.functional_call`` runs it
on any set of parameters (the gathered ones of a sharded state, for example).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

TEXT = Path(__file__).resolve().parent / "data" / "python_reference.txt"


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    context: int = 64
    dropout: float = 0.0  # on each residual branch, while training (draws from each rank's generator)


class Embed(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))


class Block(nn.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model {cfg.d_model} is not divisible by n_heads {cfg.n_heads}")
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self._drop(self.attn_proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self._drop(self.mlp_proj(F.gelu(self.fc(self.ln2(x)))))

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # no call at all without dropout: a run without it draws nothing from the generator
        return F.dropout(x, self.dropout, self.training) if self.dropout else x


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def build_gpt(cfg: GPTConfig, seed: int = 0) -> nn.Sequential:
    """``Sequential(Embed, Block x n_layers, Head)`` with GPT-2 style weights drawn from
    ``seed`` (independent of the global RNG: every rank builds the same model).

    Init: N(0, 0.02); residual projections N(0, 0.02 / sqrt(2 n_layers)); zero
    biases; LayerNorm weight 1.
    """
    model = nn.Sequential(Embed(cfg), *(Block(cfg) for _ in range(cfg.n_layers)), Head(cfg))
    g = torch.Generator().manual_seed(seed)
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name:
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def make_criterion(vocab: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mean next-character cross-entropy of logits ``[B, T, V]`` against targets ``[B, T]``."""
    return lambda logits, y: F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))


class CharText:
    """A text as character ids, split into a training part and a held-out tail."""

    def __init__(self, path: Path = TEXT, held_out: float = 0.1):
        text = path.read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.index[c] for c in text], dtype=torch.int64)
        cut = int(len(ids) * (1 - held_out))
        self.train, self.val = ids[:cut], ids[cut:]
        self.num_chars = len(text)

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in s], dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())

    def batch(
        self, batch: int, context: int, generator: torch.Generator, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, targets)``, each ``[batch, context]`` int64, at random offsets;
        ``targets`` is ``tokens`` shifted by one character."""
        ids = self.train if split == "train" else self.val
        start = torch.randint(0, len(ids) - context - 1, (batch,), generator=generator)
        window = ids[start[:, None] + torch.arange(context + 1)]
        return window[:, :-1], window[:, 1:]


@torch.no_grad()
def generate(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    prompt: torch.Tensor,
    num_chars: int,
    context: int,
    *,
    temperature: float = 0.8,
    seed: int = 0,
) -> torch.Tensor:
    """Sample ``num_chars`` character ids after ``prompt`` (1-d int64) with ``params``
    (``{name: tensor}``, e.g. gathered from a sharded state) through
    ``torch.func.functional_call``. Temperature sampling from a fixed seed;
    ``temperature=0`` is greedy."""
    g = torch.Generator().manual_seed(seed)
    ids = prompt.clone()
    for _ in range(num_chars):
        logits = torch.func.functional_call(model, dict(params), (ids[None, -context:],))[0, -1].float()
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=g)
        else:
            nxt = logits.argmax().reshape(1)
        ids = torch.cat([ids, nxt])
    return ids[len(prompt):]
