"""Gradient accumulation, clipping fused with unscaling, and hyperparameter schedules."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch._dynamo.utils import counters

import fzero
from fzero import schedules as sch
from helpers import CHEAP_COMPILE, batches, children, is_grad_reduction, max_rel_err, mlp

mse = torch.nn.functional.mse_loss


def _state_and_step(model, comm, stage, **kw):
    model = copy.deepcopy(model)  # a stage-3 state takes the module's parameters (to meta)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage, units=children,
                                   scaler=kw.pop("scaler", None))
    return state, fzero.make_train_step(fzero.module_loss(model, mse), comm, **kw)


@pytest.mark.parametrize("stage,defer", [(1, False), (2, False), (2, True), (3, False)])
def test_accumulation_equals_one_step_on_the_larger_batch(stage, defer):
    world, k = 2, 4
    model = mlp(torch.float32)
    comm = fzero.SimulatedWorld(world)
    acc_state, acc_step = _state_and_step(model, comm, stage, accum_steps=k, defer_reduce=defer)
    big_state, big_step = _state_and_step(model, comm, stage)
    for batch in batches(6, world, 2 * k, torch.float32):
        acc_state, ma = acc_step(acc_state, comm.split_batch(batch, micro_batches=k))
        big_state, mb = big_step(big_state, comm.split_batch(batch))
        assert abs(ma["loss"].item() - mb["loss"].item()) <= 1e-6 * abs(mb["loss"].item())
        assert abs(ma["grad_norm"].item() - mb["grad_norm"].item()) <= 1e-5 * mb["grad_norm"].item()
    for a, b in zip(acc_state.shard.master, big_state.shard.master):
        assert max_rel_err(a, b) <= 1e-6
    assert int(acc_state.opt.step) == 6


@pytest.mark.parametrize("stage,defer,expected_reductions", [(2, False, 4), (2, True, 1), (1, False, 1), (3, False, 4)])
def test_deferred_reduction_sends_no_gradients_on_micro_steps(stage, defer, expected_reductions):
    """Counted per flat group: stage 2 reduces every micro-step unless deferred; stage 1
    reduces once; stage 3 always reduces (and gathers) every micro-step."""
    world, k = 2, 4
    model = mlp(torch.float32)
    counting = fzero.comm.CountingCommunicator(fzero.SimulatedWorld(world))
    state, step = _state_and_step(model, counting, stage, accum_steps=k, defer_reduce=defer)
    counting.reset()
    step(state, counting.split_batch(batches(1, world, 2 * k, torch.float32)[0], micro_batches=k))
    groups = len(state.layout.groups)
    reductions = [r for r in counting.records if is_grad_reduction(r, state.layout)]
    assert len(reductions) == expected_reductions * groups
    gathers = counting.totals(["all_gather"])["calls"]
    # stages 1-2: one gather of every flat group, after the update; stage 3, per micro-step and
    # by each simulated rank for itself (W collectives where real ranks run one): one per unit in
    # forward (the root travels with the first), again in backward but for the last two units
    # (kept from their forward to their backward)
    units = len(state.module.units)
    assert groups > 1 and units > 2
    assert gathers == (world * k * (2 * units - 2) if stage == 3 else 1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_equals_clip_grad_norm_with_loss_scaling(stage):
    world, clip = 2, 0.05
    model = mlp(torch.float64)
    comm = fzero.SimulatedWorld(world)
    state, step = _state_and_step(
        model, comm, stage, clip_norm=clip, scaler=fzero.init_scaler(2.0**10, growth_interval=2)
    )
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for batch in batches(8, world, 2, torch.float64):
        state, m = step(state, comm.split_batch(batch))
        opt.zero_grad()
        x, y = batch
        (sum(mse(ref(a), b) for a, b in zip(x.chunk(world), y.chunk(world))) / world).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        assert abs(m["grad_norm"].item() - norm.item()) <= 1e-6 * norm.item()
        assert norm.item() > clip  # clipping is active in every step
    full = fzero.full_params(state.shard, comm)
    for n, p in ref.named_parameters():
        assert max_rel_err(full[n][0], p.detach()) <= 1e-6, n


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_non_finite_norm_skips_the_step(stage):
    world = 2
    model = mlp(torch.float32)
    comm = fzero.SimulatedWorld(world)
    state, step = _state_and_step(model, comm, stage, clip_norm=1.0)
    x, y = batches(1, world, 2, torch.float32)[0]
    x = x.clone()
    x[2, 1] = math.nan
    new, m = step(state, comm.split_batch((x, y)))
    assert not math.isfinite(m["grad_norm"].item()) and m["found_inf"].item() == 1.0
    for a, b in zip(new.shard.master, state.shard.master):
        assert torch.equal(a, b)
    assert int(new.opt.step) == 0


def test_schedules_match_closed_forms():
    steps = torch.arange(0, 120)
    peak, warm, total, final = 3e-3, 10, 100, 3e-4
    got = torch.stack([sch.warmup_cosine(peak, warm, total, final)(t) for t in steps])
    want = []
    for t in range(120):
        if t < warm:
            want.append(peak * t / warm)
        else:
            frac = min((t - warm) / (total - warm), 1.0)
            want.append(final + (peak - final) * 0.5 * (1 + math.cos(math.pi * frac)))
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    assert sch.constant(0.5)(torch.tensor(7)).item() == 0.5
    assert sch.linear(1.0, 3.0, 4)(torch.tensor(2)).item() == 2.0
    assert sch.linear(1.0, 3.0, 4)(torch.tensor(9)).item() == 3.0
    joined = sch.join([sch.constant(1.0), sch.linear(2.0, 0.0, 2), sch.constant(5.0)], [3, 6])
    assert [joined(torch.tensor(t)).item() for t in range(8)] == [1.0, 1.0, 1.0, 2.0, 1.0, 0.0, 5.0, 5.0]
    with pytest.raises(ValueError, match="boundar"):
        sch.join([sch.constant(1.0)], [3])


def test_schedule_drives_the_optimizer_like_torch_lambda_lr():
    """An lr schedule inside the step equals torch.optim.AdamW + LambdaLR, per group ratio kept."""
    world = 2
    model = mlp(torch.float64)
    groups = [(lambda p: p.endswith("bias"), {"lr": 5e-3})]
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2, groups=groups), comm)
    schedule = sch.warmup_cosine(1e-2, 3, 12, 1e-3)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, schedules={"lr": schedule})
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in ref.named_parameters() if not n.endswith("bias")]},
         {"params": [p for n, p in ref.named_parameters() if n.endswith("bias")], "lr": 5e-3}],
        lr=1e-2,
    )
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: schedule(torch.tensor(t)).item() / 1e-2)
    for i, batch in enumerate(batches(12, world, 2, torch.float64)):
        state, m = step(state, comm.split_batch(batch))
        assert m["lr"].item() == pytest.approx(schedule(torch.tensor(i)).item(), rel=1e-6)
        opt.zero_grad()
        x, y = batch
        (sum(mse(ref(a), b) for a, b in zip(x.chunk(world), y.chunk(world))) / world).backward()
        opt.step()
        lam.step()
    full = fzero.full_params(state.shard, comm)
    for n, p in ref.named_parameters():
        assert max_rel_err(full[n][0], p.detach()) <= 1e-10, n


def test_schedules_never_recompile_over_50_compiled_steps():
    model = mlp(torch.float32)
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm)
    torch._dynamo.reset()
    counters.clear()
    step = fzero.make_train_step(
        fzero.module_loss(model, mse), comm, compile=CHEAP_COMPILE,
        schedules={"lr": sch.warmup_cosine(1e-2, 5, 50), "weight_decay": sch.linear(0.0, 0.1, 50)},
    )
    lrs = []
    for batch in batches(50, 2, 2, torch.float32):
        state, m = step(state, comm.split_batch(batch))
        lrs.append(m["lr"].item())
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(1e-2, rel=1e-6) and lrs[-1] < 1e-4
    assert state.opt.hyper[0]["weight_decay"].item() == pytest.approx(0.1 * 49 / 50)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"] and not counters["graph_break"]


def test_unknown_scheduled_hyperparameter_is_named():
    model = mlp()
    comm = fzero.SimulatedWorld(1)
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, schedules={"beta1": sch.constant(0.9)})
    with pytest.raises(ValueError, match="beta1"):
        step(state, comm.split_batch(batches(1, 1, 2, torch.float32)[0]))
