"""Models nobody here wrote, or written as users write them, built tiny from configs
(no downloads), and a plain-torch oracle that emulates W data-parallel ranks.

The oracle is what a user would run with DDP, written without fzero: one model
copy per rank, rank 0's buffers copied to every rank before each forward
(``broadcast_buffers=True``), each rank's generator seeded with
``fzero.rng.rank_seed(seed, rank)``, per-rank forward and backward, gradients
summed over ranks and divided by W, then one ``torch.optim`` step.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fzero

VOCAB = 32
SEQ = 8

logging.getLogger("transformers").setLevel(logging.ERROR)


def checkpointing_on(m: torch.nn.Module) -> None:
    """transformers' activation checkpointing, non-reentrant: ``activation_checkpointing_enable``
    where it exists (``gradient_checkpointing_enable`` is its deprecated alias there)."""
    if hasattr(m, "activation_checkpointing_enable"):
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def gpt2(dropout: float = 0.0, seed: int = 0, checkpointing: bool = False) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )
    m = GPT2LMHeadModel(cfg).train()
    m.config.use_cache = False  # training; HF also turns it off (with a warning) under checkpointing
    if checkpointing:
        checkpointing_on(m)
    return m


def llama(seed: int = 0, checkpointing: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager",
    )
    m = LlamaForCausalLM(cfg).train()
    m.config.use_cache = False
    if checkpointing:
        checkpointing_on(m)
    return m


LORA_TARGETS = {"llama": ["q_proj", "v_proj", "up_proj", "down_proj"], "gpt2": ["c_attn", "c_fc", "c_proj"]}


def lora(kind: str, seed: int = 0) -> torch.nn.Module:
    """``peft``'s LoRA (r=4) on a tiny Llama's or GPT-2's attention and MLP projections: the base model frozen
    by peft. Each ``lora_B`` starts random (peft's zeros would leave every other weight's gradient zero at first)."""
    from peft import LoraConfig, get_peft_model

    model = {"llama": llama, "gpt2": gpt2}[kind](seed=seed)
    fan_in_fan_out = kind == "gpt2"  # GPT-2's Conv1D stores its weights transposed
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS[kind],
                                             fan_in_fan_out=fan_in_fan_out))
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return model


def new_head(seed: int = 0, labels: int = 3) -> torch.nn.Module:
    """A GPT-2 with a new classification head (``GPT2ForSequenceClassification``'s ``score``), the model's own
    ``requires_grad_(False)`` on everything else."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, num_labels=labels, pad_token_id=0,
                     attn_implementation="eager")
    m = GPT2ForSequenceClassification(cfg).train()
    m.transformer.requires_grad_(False)
    return m


def classify_batches(n: int, batch: int, seed: int = 1, labels: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (batch, SEQ), generator=g),
             "labels": torch.randint(0, labels, (batch,), generator=g)} for _ in range(n)]


MIXTRAL_VOCAB = 96


def mixtral(seed: int = 0) -> torch.nn.Module:
    """A tiny Mixtral (hidden 32, 2 layers, 4 experts, top-2; built from its config, no
    download): every decoder layer routes each token to 2 of its 4 experts by the data."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(
        vocab_size=MIXTRAL_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attn_implementation="eager", experts_implementation="eager",  # a loop over the experts hit: float64 too
    )
    m = MixtralForCausalLM(cfg).train()
    m.config.use_cache = False
    return m


class Block(torch.nn.Module):
    def __init__(self, c: int, checkpoint: bool = False):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c)
        self.checkpoint = checkpoint

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            return F.relu(x + torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False))
        return F.relu(x + self.body(x))


class ResNet(torch.nn.Module):
    """A small ResNet: stem conv + BatchNorm, two residual blocks, pooled linear head."""

    def __init__(self, c: int = 4, classes: int = 5, checkpoint: bool = False):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(c)
        self.blocks = torch.nn.Sequential(Block(c, checkpoint), Block(c, checkpoint))
        self.head = torch.nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.head(h.mean(dim=(2, 3)))


def resnet(seed: int = 0, checkpoint: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ResNet(checkpoint=checkpoint).train()


def lm_criterion(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def token_batches(n: int, batch: int, seed: int = 1, vocab: int = VOCAB) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, SEQ + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def image_batches(n: int, batch: int, dtype: torch.dtype, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 3, 6, 6, generator=g, dtype=dtype), torch.randint(0, 5, (batch,), generator=g))
        for _ in range(n)
    ]


# How a batch is given to fzero's step and to the oracle, per kind of loss.
def as_labels_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model computes its own loss: ``labels`` are the inputs (HF shifts them)."""
    return {"input_ids": batch[0], "labels": batch[0]}


def oracle_loss(kind: str) -> Callable[[torch.nn.Module, Any], torch.Tensor]:
    if kind == "labels":
        return lambda model, b: model(**b).loss
    if kind == "lm":
        return lambda model, b: lm_criterion(model(b[0]).logits, b[1])
    return lambda model, b: F.cross_entropy(model(b[0]), b[1])


def split_rows(batch: Any, world: int) -> list[Any]:
    """Rank r's part of a global batch, as ``comm.split_batch`` cuts it (contiguous)."""
    import torch.utils._pytree as tp

    leaves, spec = tp.tree_flatten(batch)
    return [tp.tree_unflatten([x.chunk(world)[r] for x in leaves], spec) for r in range(world)]


def oracle_run(
    model: torch.nn.Module,
    make_opt: Callable[[torch.nn.Module], torch.optim.Optimizer],
    data: list[Any],
    world: int,
    loss: Callable[[torch.nn.Module, Any], torch.Tensor],
    *,
    seed: int = 0,
    broadcast_buffers: bool = True,
) -> tuple[torch.nn.Module, list[torch.nn.Module], list[float]]:
    """The plain-torch W-rank run: returns (the trained model, each rank's replica, mean losses)."""
    main = copy.deepcopy(model)
    opt = make_opt(main)
    replicas = [copy.deepcopy(model) for _ in range(world)]
    gens = []
    for r in range(world):
        torch.manual_seed(fzero.rng.rank_seed(seed, r))
        gens.append(torch.get_rng_state())
    saved = torch.get_rng_state()
    losses = []
    for batch in data:
        parts = split_rows(batch, world)
        params = dict(main.named_parameters())
        if broadcast_buffers:
            rank0 = {n: b.clone() for n, b in replicas[0].named_buffers()}
        total = 0.0
        grads: dict[str, torch.Tensor] = {}
        for r, rep in enumerate(replicas):
            with torch.no_grad():
                for n, p in rep.named_parameters():
                    p.copy_(params[n])
                if broadcast_buffers:
                    for n, b in rep.named_buffers():
                        b.copy_(rank0[n])
            rep.zero_grad(set_to_none=True)
            torch.set_rng_state(gens[r])
            value = loss(rep, parts[r])
            value.backward()
            gens[r] = torch.get_rng_state()
            total += value.item()
            for n, p in rep.named_parameters():
                if p.requires_grad:  # a frozen one gets no gradient, so torch.optim leaves it
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    grads[n] = g.clone() if n not in grads else grads[n] + g
        for n, p in main.named_parameters():
            if p.requires_grad:
                p.grad = grads[n] / world
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / world)
    torch.set_rng_state(saved)
    return main, replicas, losses
