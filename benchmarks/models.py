"""A small GPT-style transformer and random token data for fzero's benchmarks.

What it provides (used by ``benchmarks/bench_gloo_step.py``):

* :class:`TinyGPT` - a plain ``nn.Module``: token embedding, learned positional
  embedding, ``n_layers`` pre-LayerNorm blocks (causal self-attention through
  ``F.scaled_dot_product_attention(is_causal=True)``, GELU MLP with 4x width),
  a final LayerNorm and an untied LM head. No buffers, no in-place parameter
  tricks, so it works with ``torch.func.functional_call``,
  ``fzero.module_loss``, DDP, ``ZeroRedundancyOptimizer`` and FSDP2's
  ``fully_shard`` alike.
* :func:`build_model` - deterministic initialisation from a seed (every rank and
  every system gets bitwise the same initial weights).
* :func:`lm_loss` / :func:`make_criterion` - next-token cross-entropy over
  ``[B, T, V]`` logits and ``[B, T]`` targets.
* :func:`random_batch` - a random ``(tokens, targets)`` batch of shape
  ``[global_batch, seq_len]`` from a ``torch.Generator`` seed (targets are the
  tokens shifted by one); the tokens follow a random Markov chain with a
  learnable successor rule, so the loss falls during a short benchmark.

Default size (:data:`DEFAULT_CONFIG`): vocab 256, d_model 128, 4 layers,
4 heads, seq 64, global batch 16: about 0.87 M parameters, chosen so one
training step on 2 gloo ranks with one thread each takes tens of ms on a CPU.

Quick check (single process)::

    python benchmarks/models.py
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "HFGPT2",
    "GPTConfig",
    "DEFAULT_CONFIG",
    "TinyGPT",
    "build_model",
    "lm_loss",
    "make_criterion",
    "random_batch",
]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 64
    global_batch: int = 16


DEFAULT_CONFIG = GPTConfig()


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT-style decoder: ``tokens [B, T] (int64) -> logits [B, T, vocab]``."""

    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, seq_len: int):
        super().__init__()
        self.vocab, self.seq_len = vocab, seq_len
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self._n_layers = n_layers

    def reset_parameters(self, generator: torch.Generator) -> None:
        """GPT-2 style init: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layers),
        zero biases, LayerNorm (1, 0). Drawn in module order from ``generator``."""
        resid_std = 0.02 / math.sqrt(2 * self._n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln" in name or name.startswith("ln_"):
                    p.fill_(1.0)
                else:
                    std = resid_std if name.endswith("proj.weight") else 0.02
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(cfg: GPTConfig = DEFAULT_CONFIG, seed: int = 0) -> TinyGPT:
    """A :class:`TinyGPT` for ``cfg`` with deterministic weights from ``seed``
    (independent of the global RNG, so every rank and system starts identical)."""
    model = TinyGPT(cfg.vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len)
    model.reset_parameters(torch.Generator().manual_seed(seed))
    return model


class HFGPT2(nn.Module):
    """A ``transformers`` GPT-2 (tied embeddings) of the same size as :class:`TinyGPT`,
    returning logits, so every benchmarked system runs it as it runs the TinyGPT.
    ``blocks``: its transformer blocks (what FSDP2 and fzero stage 3 shard as units)."""

    def __init__(self, cfg: GPTConfig, seed: int):
        super().__init__()
        import logging

        from transformers import GPT2Config, GPT2LMHeadModel

        logging.getLogger("transformers").setLevel(logging.ERROR)
        torch.manual_seed(seed)
        self.hf = GPT2LMHeadModel(GPT2Config(
            vocab_size=cfg.vocab, n_positions=cfg.seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
            n_head=cfg.n_heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0,
        )).train()
        self.hf.config.use_cache = False

    @property
    def blocks(self) -> nn.ModuleList:
        return self.hf.transformer.h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens).logits


LORA_RANK = 8
LORA_TARGETS = ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"]  # every attention and MLP projection


def lora_model(cfg: GPTConfig, seed: int = 0, rank: int = LORA_RANK) -> nn.Module:
    """:func:`build_model` with ``peft`` LoRA (rank ``rank``, alpha ``2 * rank``) injected in place into every
    attention and MLP projection (``inject_adapter_in_model``: the model keeps its type and ``blocks``), everything
    else frozen: a fine-tuning job. The adapters start as peft starts them (``lora_A`` random from ``seed``,
    ``lora_B`` zeros), the same on every rank and system."""
    from peft import LoraConfig, inject_adapter_in_model

    model = build_model(cfg, seed)
    torch.manual_seed(seed)
    model = inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                               target_modules=LORA_TARGETS), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def build(kind: str, cfg: GPTConfig, seed: int = 0) -> nn.Module:
    """``kind="tiny"``: :func:`build_model`; ``"tiny-lora"``: :func:`lora_model`; ``"hf-gpt2"``: :class:`HFGPT2` of
    the same size."""
    if kind == "tiny":
        return build_model(cfg, seed)
    if kind == "tiny-lora":
        return lora_model(cfg, seed)
    if kind == "hf-gpt2":
        return HFGPT2(cfg, seed)
    raise ValueError(f"unknown model {kind!r}: tiny, tiny-lora or hf-gpt2")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy: logits ``[B, T, V]``, targets ``[B, T]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_criterion(vocab: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The criterion the benchmark gives ``fzero.module_loss``: cross-entropy with a
    static vocabulary size (same numbers as :func:`lm_loss`)."""
    return lambda logits, y: F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))


def random_batch(
    cfg: GPTConfig = DEFAULT_CONFIG, seed: int = 0, copy_prob: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``(tokens, targets)`` batch, each ``[global_batch, seq_len]`` int64,
    drawn from ``torch.Generator().manual_seed(seed)``; ``targets`` is ``tokens``
    shifted left by one (next-token prediction).

    The stream is a random Markov chain: each next token is, with probability
    ``copy_prob``, the successor of the current one under a fixed random
    permutation of the vocabulary (the same for every seed), otherwise uniform.
    So the loss can fall (from ~ln V towards ~2.8 nats at 0.5) and a benchmark's
    loss agreement check means something; ``copy_prob=0`` gives i.i.d. uniform tokens.
    """
    succ = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(12345))
    g = torch.Generator().manual_seed(seed)
    b, t = cfg.global_batch, cfg.seq_len + 1
    rnd = torch.randint(0, cfg.vocab, (b, t), generator=g)
    keep = torch.rand(b, t, generator=g) < copy_prob
    stream = rnd.clone()
    for i in range(1, t):
        stream[:, i] = torch.where(keep[:, i], succ[stream[:, i - 1]], rnd[:, i])
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def _self_check() -> None:
    import time

    import fzero

    torch.set_num_threads(1)
    cfg = DEFAULT_CONFIG
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    x, y = random_batch(cfg, 1)
    ref = lm_loss(model(x), y)
    params = dict(model.named_parameters())
    via_fc = lm_loss(torch.func.functional_call(model, params, (x,)), y)
    loss_fn = fzero.module_loss(model, make_criterion(cfg.vocab))
    via_fz = loss_fn({k: v.detach() for k, v in params.items()}, (x, y))
    print(f"{cfg}\n{n:,} parameters; loss {ref.item():.6f} (ln V = {math.log(cfg.vocab):.6f}); "
          f"functional_call {via_fc.item():.6f}; fzero.module_loss {via_fz.item():.6f}")
    b = cfg.global_batch // 2
    t0 = time.perf_counter()
    for _ in range(5):
        model.zero_grad()
        lm_loss(model(x[:b]), y[:b]).backward()
    print(f"eager forward+backward of one rank's micro-batch ({b}x{cfg.seq_len}), 1 thread: "
          f"{(time.perf_counter() - t0) / 5 * 1e3:.1f} ms")


if __name__ == "__main__":
    _self_check()
