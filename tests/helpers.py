"""Small models and reference training loops shared by the tests."""

from __future__ import annotations

import copy
from typing import Callable

import torch

import fzero


def mlp(dtype: torch.dtype = torch.float32, seed: int = 0, sizes=(6, 9, 5, 3)) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    layers.insert(2, torch.nn.LayerNorm(sizes[1]))
    return torch.nn.Sequential(*layers[:-1]).to(dtype)


def batches(n: int, world: int, per_rank: int, dtype: torch.dtype, seed: int = 1, d_in: int = 6, d_out: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(world * per_rank, d_in, generator=g, dtype=dtype),
            torch.randn(world * per_rank, d_out, generator=g, dtype=dtype),
        )
        for _ in range(n)
    ]


def reference_run(
    model: torch.nn.Module,
    make_opt: Callable[[torch.nn.Module], torch.optim.Optimizer],
    data,
    world: int,
) -> torch.nn.Module:
    """Single-process torch.optim training on the gradient averaged over ``world`` micro-batches."""
    model = copy.deepcopy(model)
    opt = make_opt(model)
    for x, y in data:
        opt.zero_grad()
        losses = [
            torch.nn.functional.mse_loss(model(xr), yr)
            for xr, yr in zip(x.chunk(world), y.chunk(world))
        ]
        (sum(losses) / world).backward()
        opt.step()
    return model


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def params_of_rank(state: fzero.TrainState, comm: fzero.Communicator, row: int) -> dict[str, torch.Tensor]:
    full = fzero.all_gather_params(state.shard, comm)
    return {k: v[row] for k, v in full.items()}


def children(name: str, module: torch.nn.Module) -> bool:
    """Wrap policy: every top-level child of the model is a stage-3 shard unit."""
    return "." not in name
