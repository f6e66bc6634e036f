"""Stage 1 and 2 on a simulated world equal single-process torch.optim on the averaged gradient."""

from __future__ import annotations

import pytest
import torch

import fzero
from helpers import batches, max_rel_err, mlp, reference_run

STEPS = 20


def _no_decay(path: str) -> bool:
    return path.endswith("bias") or path.startswith("2.")  # biases and the LayerNorm


OPTIMIZERS = {
    "sgd": (
        lambda: fzero.sgd(lr=0.05),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
    ),
    "sgd_momentum_wd_dampening": (
        lambda: fzero.sgd(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2),
    ),
    "sgd_nesterov_maximize": (
        lambda: fzero.sgd(lr=0.02, momentum=0.8, nesterov=True, maximize=True),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.8, nesterov=True, maximize=True),
    ),
    "adam": (
        lambda: fzero.adam(lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-3),
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-3),
    ),
    "adam_amsgrad": (
        lambda: fzero.adam(lr=1e-2, amsgrad=True),
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
    ),
    "adamw": (
        lambda: fzero.adamw(lr=1e-2, weight_decay=0.1),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    ),
    "adamw_groups": (
        lambda: fzero.adamw(lr=1e-2, weight_decay=0.1, groups=[(_no_decay, {"weight_decay": 0.0, "lr": 5e-3})]),
        lambda m: torch.optim.AdamW(
            [
                {"params": [p for n, p in m.named_parameters() if not _no_decay(n)]},
                {"params": [p for n, p in m.named_parameters() if _no_decay(n)], "weight_decay": 0.0, "lr": 5e-3},
            ],
            lr=1e-2,
            weight_decay=0.1,
        ),
    ),
}


def _fzero_run(model, optimizer, data, world, stage, dtype):
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, optimizer, comm, stage=stage, alignment=4)
    step = fzero.make_train_step(fzero.module_loss(model, torch.nn.functional.mse_loss), comm)
    for batch in data:
        state, metrics = step(state, comm.split_batch(batch))
        assert metrics["found_inf"].item() == 0.0
    return state, comm


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", ["sgd_momentum_wd_dampening", "adam", "adamw"])
def test_parity_with_torch_optim(name, stage, world, dtype, tol):
    make_fzero, make_torch = OPTIMIZERS[name]
    model = mlp(dtype)
    data = batches(STEPS, world, 2, dtype)
    ref = reference_run(model, make_torch, data, world)
    state, comm = _fzero_run(model, make_fzero(), data, world, stage, dtype)
    gathered = fzero.full_params(state.shard, comm)
    assert int(state.opt.step) == STEPS
    for n, p in ref.named_parameters():
        for r in range(world):  # every rank holds the same parameters
            assert max_rel_err(gathered[n][r], p.detach()) <= tol, (n, r)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_variants_f64(name):
    make_fzero, make_torch = OPTIMIZERS[name]
    world, dtype = 3, torch.float64
    model = mlp(dtype)
    data = batches(STEPS, world, 2, dtype)
    ref = reference_run(model, make_torch, data, world)
    state, comm = _fzero_run(model, make_fzero(), data, world, 2, dtype)
    gathered = fzero.full_params(state.shard, comm)
    for n, p in ref.named_parameters():
        assert max_rel_err(gathered[n][0], p.detach()) <= 1e-10, n


def test_moments_equal_torch_adam_state():
    """The sharded moments, gathered, equal torch.optim.Adam's per-parameter state."""
    world, dtype = 4, torch.float64
    model = mlp(dtype)
    data = batches(STEPS, world, 2, dtype)
    make_fzero, make_torch = OPTIMIZERS["adam"]
    ref_model = mlp(dtype)
    opt = make_torch(ref_model)
    for x, y in data:
        opt.zero_grad()
        losses = [torch.nn.functional.mse_loss(ref_model(a), b) for a, b in zip(x.chunk(world), y.chunk(world))]
        (sum(losses) / world).backward()
        opt.step()
    state, comm = _fzero_run(model, make_fzero(), data, world, 2, dtype)
    lay = state.shard.layout
    for g, moments in zip(lay.groups, state.opt.moments):
        for name, m in zip(("exp_avg", "exp_avg_sq"), moments):
            full = m.reshape(-1)  # rows are ranks in order: the whole padded buffer
            for i in g.slots:
                s = lay.slots[i]
                p = dict(ref_model.named_parameters())[s.path]
                got = full[s.offset : s.offset + s.numel].view(s.shape)
                assert max_rel_err(got, opt.state[p][name]) <= 1e-10, (s.path, name)
            assert torch.all(full[g.numel :] == 0), "padding of moments must stay zero"
        assert int(state.opt.step) == int(opt.state[p]["step"])


def test_by_hand_composition_equals_helper():
    """The pieces composed by hand give bitwise the helper's step."""
    world, dtype = 2, torch.float32
    model = mlp(dtype)
    comm = fzero.SimulatedWorld(world)
    opt = fzero.adamw(lr=1e-2)
    state = fzero.init_train_state(model, opt, comm)
    step = fzero.make_train_step(fzero.module_loss(model, torch.nn.functional.mse_loss), comm)
    shard, opt_state, scaler = state.shard, state.opt, state.scaler
    for batch in batches(5, world, 2, dtype):
        x, y = comm.split_batch(batch)
        state, _ = step(state, (x, y))
        params = fzero.full_params(shard, comm)
        grads = {}
        for r in range(world):
            p_r = {k: v[r].detach().requires_grad_(True) for k, v in params.items()}
            loss = torch.nn.functional.mse_loss(torch.func.functional_call(model, p_r, (x[r],)), y[r])
            g = torch.autograd.grad(fzero.scale(scaler, loss), list(p_r.values()))
            for k, gi in zip(p_r, g):
                grads.setdefault(k, []).append(gi)
        grads = {k: torch.stack(v) for k, v in grads.items()}
        shards = fzero.reduce_scatter_grads(shard, grads, comm)
        shards, found_inf = fzero.unscale_and_check(scaler, shards, comm)
        shard, opt_state = fzero.shard_step(shard, opt_state, shards, found_inf)
        scaler = fzero.update_scale(scaler, found_inf)
    for a, b in zip(shard.master, state.shard.master):
        assert torch.equal(a, b)
