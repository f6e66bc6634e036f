"""Expert parallelism on tiny ``transformers`` MoE models (Mixtral, Qwen2-MoE; built from configs, float64, their
load-balancing loss on): fzero with the sparse blocks converted by ``fzero.moe.expert_parallel`` at EP = 2 on
W = 4, against a single-process oracle that holds every expert and averages every gradient over the world's parts as
DDP would (each expert's gradient from the tokens routed to it on every rank). Shared by ``test_moe.py`` (the
simulated world) and ``moe_worker.py`` (four gloo ranks, bitwise equal to it)."""

from __future__ import annotations

from typing import Any

import torch

import fzero
import fzero.moe as moe
from fzero.lockstep import current

W, EP, SEQ, VOCAB = 4, 2, 8, 32
PER_RANK = 2
STEPS = 3


def model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny MoE causal LM (hidden 16, 2 layers, 4 experts, top-2), float64, with its load-balancing loss."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, num_experts_per_tok=2, max_position_embeddings=SEQ, bos_token_id=0,
                  eos_token_id=0, pad_token_id=0, attn_implementation="eager", experts_implementation="eager",
                  output_router_logits=True, router_aux_loss_coef=0.02, use_cache=False)
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        m = MixtralForCausalLM(MixtralConfig(intermediate_size=24, num_local_experts=4, **common))
    else:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        m = Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=12, num_experts=4,
                                               shared_expert_intermediate_size=20, norm_topk_prob=True, **common))
    m = m.double().train()
    m.config.use_cache = False
    return m


def batches(steps: int, parts: int, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (parts * PER_RANK, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def run_oracle(kind: str, clip: float | None, accum: int = 1, steps: int = STEPS, opt: str = "adamw") -> dict[str, Any]:
    """One model holding every expert: each of the ``W * accum`` parts' losses (the model's own, with its
    load-balancing term), their gradients averaged (a parameter no part reached keeps ``None``: torch.optim skips it),
    ``clip_grad_norm_``, then ``torch.optim``'s step."""
    m = model(kind)
    optim = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
             "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9)}[opt](m.parameters())
    losses, norms = [], []
    for batch in batches(steps, W * accum):
        parts = [{k: v.chunk(W * accum)[i] for k, v in batch.items()} for i in range(W * accum)]
        grads: dict[str, torch.Tensor] = {}
        total = 0.0
        for part in parts:
            m.zero_grad(set_to_none=True)
            loss = m(**part).loss
            loss.backward()
            total += loss.item()
            for n, p in m.named_parameters():
                if p.grad is not None:
                    grads[n] = grads.get(n, 0) + p.grad
        for n, p in m.named_parameters():
            p.grad = grads[n] / (W * accum) if n in grads else None
        with_grad = [p for p in m.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(with_grad, clip if clip is not None else float("inf"))
        norms.append(norm.item())
        optim.step()
        losses.append(total / (W * accum))
    return {"params": {n: p.detach().clone() for n, p in m.named_parameters()}, "losses": losses, "norms": norms}


def expected_rows(oracle: dict[str, Any], experts: moe.ExpertGroup, ranks: range) -> list[dict[str, torch.Tensor]]:
    """What rank ``r`` of the expert-parallel run holds of the oracle's parameters: the dense ones whole, of each
    sparse block its slice of the experts (rank ``r``'s place in its expert-parallel group: ``r % EP``)."""
    out = []
    for r in ranks:
        row = {}
        for n, v in oracle["params"].items():
            if n in experts.paths:
                local = v.shape[0] // EP
                v = v[(r % EP) * local:(r % EP + 1) * local]
            row[n] = v
        out.append(row)
    return out


def run_fzero(kind: str, comm: fzero.Communicator, stage: int, clip: float | None, accum: int = 1,
              steps: int = STEPS, opt: str = "adamw", counter: fzero.CountingCommunicator | None = None,
              record: list | None = None) -> dict[str, Any]:
    """fzero's run of the converted model on ``comm`` (``counter``: a CountingCommunicator wrapping it, the step's
    and the layers' communicator, reset before each step; ``record``: ``(row, top-k experts)`` of every router call of
    the last step, by a forward hook on every router)."""
    m = model(kind)
    experts = moe.expert_parallel(m, counter or comm)
    make = {"adamw": lambda: fzero.adamw(lr=1e-2, weight_decay=0.1), "sgd": lambda: fzero.sgd(lr=0.5, momentum=0.9)}
    state = fzero.init_train_state(m, make[opt](), comm, stage=stage, groups={moe.EXPERTS: experts})
    step = fzero.make_train_step(fzero.module_loss(m), counter or comm, clip_norm=clip, accum_steps=accum)
    if record is not None:
        for name, mod in m.named_modules():
            if name.endswith("mlp.gate"):
                mod.register_forward_hook(lambda mod, args, out: record.append(
                    (where[1] if (where := current()) is not None else 0, out[2].detach().clone())))
    losses, norms = [], []
    for batch in batches(steps, comm.data_world_size * accum):
        if counter is not None:
            counter.reset()
        if record is not None:
            record.clear()
        state, metrics = step(state, comm.split_batch(batch, micro_batches=accum))
        losses.append(metrics["loss"].item())
        norms.append(metrics["grad_norm"].item())
    rows = fzero.full_params(state.shard, comm)
    return {"params": [{n: v[r].clone() for n, v in rows.items()} for r in range(comm.local_ranks)],
            "losses": losses, "norms": norms, "experts": experts, "state": state, "model": m}
