"""Parameters sharded over groups of their own (``init_train_state(groups=)``): a model whose experts each rank group
holds its own values of, trained by fzero against a plain-torch oracle that emulates every rank. Shared by
``test_param_groups.py`` (the simulated world) and ``param_group_worker.py`` (gloo ranks, bitwise equal to it).

The model: a dense embedding and router, and ``EXPERTS`` local experts, each token to its top-1 expert; an expert no
token of a rank's batch reaches is not called (no gradient there). Expert parameters are in the group
``"experts"``, whose rank groups are ``{0, 2}`` and ``{1, 3}`` on four ranks (the ranks holding the same experts, as
an expert-data-parallel group beside expert parallelism of 2); everything else is sharded over the world.

The oracle's semantics (DDP's, per rank group): every rank holds a copy of the model; a dense gradient is the mean
over the world of every rank's gradient; an expert's is the sum over its rank group's ranks divided by the world's
size (the gradient of the world's mean loss for that rank group's experts); a parameter no rank of its group had a
gradient for keeps ``None`` (``torch.optim`` skips it). Clipping: ``clip_grad_norm_`` over every distinct parameter
(the dense ones once, each rank group's experts once). Then each copy takes ``torch.optim``'s step.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import fzero

EXPERTS = 2
DIM = 6
PER_RANK = 4
STEPS = 4
GROUPS = {"experts": [[0, 2], [1, 3]]}


def in_experts(path: str) -> bool:
    return ".experts." in path


class MoE(torch.nn.Module):
    """A router and ``EXPERTS`` experts, each token to its top-1 expert, weighted by its router probability."""

    def __init__(self, masked: bool = False) -> None:
        super().__init__()
        self.masked = masked
        self.router = torch.nn.Linear(DIM, EXPERTS, dtype=torch.float64)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM, dtype=torch.float64) for _ in range(EXPERTS))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.router(h), dim=-1)
        choice = weights.argmax(dim=-1)
        if self.masked:  # every expert on every token, kept where chosen: no host read (compiles in one graph)
            picked = torch.nn.functional.one_hot(choice, EXPERTS).to(h.dtype) * weights
            return h + sum(picked[:, e:e + 1] * expert(h) for e, expert in enumerate(self.experts))
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            chosen = (choice == e).nonzero().squeeze(1)
            if chosen.numel():  # an expert no token reaches is not called (a host read: the model's own choice)
                out = out.index_add(0, chosen, weights[chosen, e:e + 1] * expert(h[chosen]))
        return h + out


class LocalExperts(torch.nn.Module):
    """A dense embedding, a :class:`MoE` layer, a dense head; float64."""

    def __init__(self, seed: int = 0, masked: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(DIM, DIM, dtype=torch.float64)
        self.moe = MoE(masked)
        self.head = torch.nn.Linear(DIM, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(torch.tanh(self.embed(x))))


def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def batches(world: int, steps: int = STEPS, starve: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``world * PER_RANK`` rows; ``starve``: in step 1, ranks 1 and 3 get inputs that
    send every token to expert 0 (:data:`STARVING`), so expert 1 of rank group 1 has no gradient in that step."""
    g = torch.Generator().manual_seed(7)
    out = []
    for s in range(steps):
        x = torch.randn(world * PER_RANK, DIM, generator=g, dtype=torch.float64)
        y = torch.randn(world * PER_RANK, 1, generator=g, dtype=torch.float64)
        if starve and s == 1:
            for r in (1, 3):
                x[r * PER_RANK:(r + 1) * PER_RANK] = STARVING
        out.append((x, y))
    return out


# an input the router of LocalExperts(seed=0) sends to expert 0, found once (a fixed row, checked by the test)
STARVING = torch.full((DIM,), 0.5, dtype=torch.float64)


def rank_groups(world: int) -> list[list[int]]:
    return GROUPS["experts"] if world == 4 else [list(range(world))]


def run_oracle(world: int, clip: float | None, accum: int = 1, starve: bool = False, opt: str = "adamw",
               steps: int = STEPS, masked: bool = False, unused: str = "skip") -> dict[str, Any]:
    """Each rank's parameters after training, its losses, and the global gradient norms (before clipping).
    ``unused="zeros"``: a parameter no rank of its group had a gradient for takes a zero gradient."""
    base = LocalExperts(masked=masked)
    copies = [copy.deepcopy(base) for _ in range(world)]
    make = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=2e-2, weight_decay=0.1),
            "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}[opt]
    optims = [make(m.parameters()) for m in copies]
    group_of = {r: q for q, g in enumerate(rank_groups(world)) for r in g}
    losses, norms = [], []
    for batch in batches(world * accum, steps, starve):
        parts = [tuple(t.chunk(world * accum)[i] for t in batch) for i in range(world * accum)]
        grads: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
        total = 0.0
        for r, m in enumerate(copies):
            for k in range(accum):
                m.zero_grad(set_to_none=True)
                value = loss(m, parts[r * accum + k]) / accum
                value.backward()
                total += value.item()
                for n, p in m.named_parameters():
                    if p.grad is not None:
                        grads[r][n] = grads[r].get(n, 0) + p.grad
        averaged: list[dict[str, torch.Tensor | None]] = []
        for r in range(world):
            out: dict[str, torch.Tensor | None] = {}
            for n, p in copies[r].named_parameters():
                over = [s for s in range(world) if group_of[s] == group_of[r]] if in_experts(n) else range(world)
                got = [grads[s][n] for s in over if n in grads[s]]
                out[n] = sum(got) / world if got else None if unused == "skip" else torch.zeros_like(p)
            averaged.append(out)
        # every distinct parameter once: the dense ones of rank 0, each rank group's experts of its first rank
        firsts = [g[0] for g in rank_groups(world)]
        distinct = [g for n, g in averaged[0].items() if not in_experts(n) and g is not None]
        distinct += [g for q in firsts for n, g in averaged[q].items() if in_experts(n) and g is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in distinct]))
        norms.append(norm.item())
        factor = min(1.0, clip / (norm.item() + 1e-6)) if clip is not None else 1.0
        for r, m in enumerate(copies):
            for n, p in m.named_parameters():
                g = averaged[r][n]
                p.grad = None if g is None else g * factor
            optims[r].step()
        losses.append(total / world)
    return {"params": [{n: p.detach().clone() for n, p in m.named_parameters()} for m in copies],
            "losses": losses, "norms": norms}


def run_fzero(comm: fzero.Communicator, stage: int, clip: float | None, accum: int = 1, starve: bool = False,
              opt: str = "adamw", compile: Any = False, unused: str = "skip", steps: int = STEPS,
              counter: fzero.CountingCommunicator | None = None, masked: bool = False,
              groups: bool | None = True, donate: bool = False, bf16: bool = False) -> dict[str, Any]:
    """fzero's run: each local row's parameters, the losses and the global norms (``counter``: the step's
    communicator, wrapping ``comm``, reset before each step so it holds the last step's collectives; ``groups``:
    the experts in their group, else over the world; ``bf16``: a float32 model computing and reducing in
    bfloat16)."""
    model = LocalExperts(masked=masked)
    precision = fzero.MixedPrecision()
    if bf16:
        model = model.float()
        precision = fzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    make = {"adamw": lambda: fzero.adamw(lr=2e-2, weight_decay=0.1),
            "sgd": lambda: fzero.sgd(lr=0.1, momentum=0.9)}[opt]
    units = dict(units=lambda name, m: name in ("moe", "head")) if stage == 3 else {}
    state = fzero.init_train_state(model, make(), comm, stage=stage, alignment=4, precision=precision,
                                   groups={"experts": in_experts} if groups else None, **units)
    step = fzero.make_train_step(fzero.module_loss(model, torch.nn.functional.mse_loss), counter or comm,
                                 clip_norm=clip, accum_steps=accum, compile=compile, unused=unused, donate=donate)
    losses, norms = [], []
    for b in batches(comm.data_world_size * accum, steps, starve):
        b = tuple(t.to(next(model.parameters()).dtype) if bf16 else t for t in b)
        if counter is not None:
            counter.reset()
        state, metrics = step(state, comm.split_batch(b, micro_batches=accum))
        losses.append(metrics["loss"].item())
        norms.append(metrics["grad_norm"].item())
    rows = fzero.full_params(state.shard, comm)
    params = [{n: v[r].clone() for n, v in rows.items()} for r in range(comm.local_ranks)]
    return {"params": params, "losses": losses, "norms": norms, "state": state}
