"""Parameters some steps leave without a gradient on every rank, or on some ranks: fzero
against DDP's semantics (``find_unused_parameters=True``: a parameter no rank used keeps a
``None`` gradient and ``torch.optim`` skips it). Shared by ``test_unused_params.py`` (the
simulated world and a plain-torch oracle in one process) and ``dist_worker.py`` (gloo ranks
against DDP itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import fzero

mse = torch.nn.functional.mse_loss
STEPS = 5
PER_RANK = 3


class Gated(torch.nn.Module):
    """``branch`` runs for a batch whose first input is positive (``branch=None``; a
    data-dependent branch, which ``torch.compile(fullgraph=True)`` cannot trace) or always
    (``branch=True``); ``aux`` never runs (no rank ever takes it, as a disabled head); ``a``
    and ``b`` always run."""

    def __init__(self, branch: bool | None = None) -> None:
        super().__init__()
        self.static_branch = branch
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 8, dtype=torch.float64)
        self.branch = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.aux = torch.nn.Linear(8, 3, dtype=torch.float64)
        self.b = torch.nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.static_branch if self.static_branch is not None else bool(x[0, 0] > 0):
            h = h + torch.tanh(self.branch(h))
        if self.static_branch is None and bool(x[0, 0] > 1e9):  # never
            return self.aux(h)
        return self.b(h)


# step -> which ranks take the branch: rank 0 alone (one rank), nobody (its step count falls
# behind the optimizer's), then both
TAKES = {0: (0,), 1: (0,), 2: (), 3: (0, 1), 4: (0,)}


def batches(world: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for s in range(steps):
        x = torch.randn(world * PER_RANK, 6, generator=g, dtype=torch.float64)
        y = torch.randn(world * PER_RANK, 3, generator=g, dtype=torch.float64)
        for r in range(world):
            x[r * PER_RANK, 0] = 1.0 if r in TAKES[s % len(TAKES)] else -1.0
        out.append((x, y))
    return out


OPTIMIZERS: dict[str, tuple[Callable[[], fzero.Optimizer], Callable[[Any], torch.optim.Optimizer]]] = {
    "adamw": (lambda: fzero.adamw(lr=1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "sgd": (lambda: fzero.sgd(lr=0.1, momentum=0.9, weight_decay=0.01),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)),
    # torch.optim classes run by piece, with per-parameter scalar state (mu_product; eta, mu)
    "nadam": (lambda: fzero.from_torch_optim(torch.optim.NAdam, lr=1e-2, weight_decay=0.1),
              lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.1)),
    "asgd": (lambda: fzero.from_torch_optim(torch.optim.ASGD, lr=1e-2, t0=2.0, weight_decay=0.1),
             lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=2.0, weight_decay=0.1)),
}
# stage 3: the head no rank runs is a shard unit, and so is b; the branch stays in the root (held
# for the whole step): a unit some ranks skip would leave their gathers unmatched on real ranks
UNITS = ("aux", "b")


def run_fzero(comm: fzero.Communicator, opt: str, stage: int, compile: fzero.compiled.Compile = False,
              unused: str = "skip", accum: int = 1, branch: bool | None = None) -> dict[str, Any]:
    """Train :class:`Gated`; every parameter (row 0 of this process) and each parameter's own
    step count (``opt.step - opt.missed``)."""
    model = Gated(branch)
    units = dict(units=lambda name, m: name in UNITS) if stage == 3 else {}
    state = fzero.init_train_state(model, OPTIMIZERS[opt][0](), comm, stage=stage, alignment=4, **units)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=compile,
                                 unused=unused, accum_steps=accum)
    for b in batches(comm.world_size * accum):
        state, _ = step(state, comm.split_batch(b, micro_batches=accum))
    rows = {k: v.clone() for k, v in fzero.full_params(state.shard, comm).items()}
    counts = state.opt.step - state.opt.missed[0]
    return {"params": {k: v[0] for k, v in rows.items()}, "rows": rows,
            "steps": dict(zip([s.path for s in state.layout.trainable_slots], counts.tolist()))}


def run_ddp(comm: fzero.Communicator, opt: str, branch: bool | None = None) -> dict[str, torch.Tensor]:
    """The same training under DDP (``find_unused_parameters=True``) on this process's rank."""
    model = torch.nn.parallel.DistributedDataParallel(Gated(branch), find_unused_parameters=True)
    optim = OPTIMIZERS[opt][1](model.parameters())
    for x, y in batches(comm.world_size):
        xr, yr = (t.chunk(comm.world_size)[comm.ranks[0]] for t in (x, y))
        optim.zero_grad(set_to_none=True)
        mse(model(xr), yr).backward()
        optim.step()
    return {k: v.detach().clone() for k, v in model.module.named_parameters()}


def run_oracle(world: int, opt: str, branch: bool | None = None) -> dict[str, torch.Tensor]:
    """DDP's semantics in one process: each rank's gradient, averaged over ranks where some rank
    has one (zeros from the others), ``None`` where none has; ``torch.optim`` steps."""
    model = Gated(branch)
    optim = OPTIMIZERS[opt][1](model.parameters())
    for x, y in batches(world):
        grads: dict[str, torch.Tensor] = {}
        for xr, yr in zip(x.chunk(world), y.chunk(world)):
            model.zero_grad(set_to_none=True)
            mse(model(xr), yr).backward()
            for n, p in model.named_parameters():
                if p.grad is not None:
                    grads[n] = grads.get(n, 0) + p.grad
        for n, p in model.named_parameters():
            p.grad = grads[n] / world if n in grads else None
        optim.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}
