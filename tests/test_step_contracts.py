"""Small contracts of make_train_step that the larger tests do not pin: a loss without an
autograd graph is named, the schedules are captured when the step is made, and compiled
steps with several backward regions turn inductor's tag-based rematerialisation off."""

from __future__ import annotations

import pytest
import torch

import fzero
from helpers import CHEAP_COMPILE, batches, mlp

mse = torch.nn.functional.mse_loss


def test_a_loss_without_a_graph_is_named():
    model = mlp()
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm)
    step = fzero.make_train_step(lambda params, batch: batch[1].sum() * 0.0, comm)
    with pytest.raises(ValueError, match="does not depend on the trainable parameters"):
        step(state, comm.split_batch(batches(1, 2, 2, torch.float32)[0]))


def test_schedules_are_captured_when_the_step_is_made():
    """Like every other option, the schedules mapping is read once: emptying the caller's
    dict afterwards does not change the step (the lr metric still follows the schedule)."""
    model = mlp()
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm)
    schedules = {"lr": lambda step: 0.5 / (step.to(torch.float64) + 1.0)}
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, schedules=schedules)
    schedules.clear()
    lrs = []
    for b in batches(3, 2, 2, torch.float32):
        state, m = step(state, comm.split_batch(b))
        lrs.append(m["lr"].item())
    assert lrs == pytest.approx([0.5, 0.25, 0.5 / 3])


@pytest.mark.parametrize("world,accum,regions", [(1, 1, 1), (1, 3, 3), (2, 2, 4)])
def test_compiled_step_counts_backward_regions(monkeypatch, world, accum, regions):
    """bind_step gets local ranks x micro-batches: inductor's tag-based remat is kept
    only for one backward region (see fzero.compiled.bind_step)."""
    import fzero.step as step_module

    seen = []
    real = step_module.bind_step
    monkeypatch.setattr(step_module, "bind_step", lambda fn, loss, comm, **kw: seen.append(
        comm.local_ranks * kw["accum_steps"]) or real(fn, loss, comm, **kw))
    model = mlp()
    comm = fzero.SimulatedWorld(world)
    fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=True, accum_steps=accum)
    assert seen == [regions]


def test_a_stage3_state_is_refused_by_a_stage12_step():
    model = mlp()
    comm = fzero.SimulatedWorld(2)
    s3 = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm, stage=3, units=lambda name, m: "." not in name)
    batch = comm.split_batch(batches(1, 2, 2, torch.float32)[0])
    for stage in (1, 2):
        step = fzero.make_train_step(fzero.module_loss(model, mse), comm, stage=stage)
        with pytest.raises(ValueError, match=rf"stage={stage}\): this state was built for stage 3"):
            step(s3, batch)


def _dropout_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("world", [1, 2])
def test_compiled_randomness_warns_only_for_several_simulated_ranks(world):
    """A compiled step carries one generator stream: exact on one row (a real rank); with
    several simulated rows every row draws from row 0's, and the step warns, once."""
    import warnings

    model = _dropout_mlp()
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm, seed=3)
    # one row on inductor (its own random ops carry the stream); several rows: the warning
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=True if world == 1 else CHEAP_COMPILE)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in batches(2, world, 2, torch.float32):
            new, _ = step(state, comm.split_batch(b))
            assert not torch.equal(new.rng[0][0], state.rng[0][0])  # row 0's stream advanced
            state = new
    ours = [w for w in caught if "drew from one generator" in str(w.message)]
    assert len(ours) == (1 if world > 1 else 0)


def test_clipping_never_scales_gradients_up():
    """clip_norm above the gradient norm leaves the step as without clipping (the
    coefficient of clip_grad_norm_ is clamped at 1)."""
    out = {}
    for clip in (None, 1e6):
        model = mlp(torch.float64)
        comm = fzero.SimulatedWorld(2)
        state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm)
        step = fzero.make_train_step(fzero.module_loss(model, mse), comm, clip_norm=clip)
        for b in batches(2, 2, 2, torch.float64):
            state, m = step(state, comm.split_batch(b))
        assert 0 < m["grad_norm"].item() < 1e6
        out[clip] = state
    for a, b in zip(out[None].shard.master, out[1e6].shard.master):
        assert torch.equal(a, b)


def test_every_metric_is_a_0d_float64_tensor():
    """Metrics share one dtype whatever the state holds (float32 scales and flags, float64
    hyperparameters, integer counters), so they stack and log alike; float64, the agreement's
    own, so a float64 model's loss and norm compare at 1e-10."""
    model = mlp(torch.float64)
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-3), comm)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, clip_norm=1.0, check_replicas_every=1)
    _, metrics = step(state, comm.split_batch(batches(1, 2, 2, torch.float64)[0]))
    assert set(metrics) == {"loss", "found_inf", "scale", "grad_norm", "lr", "replicas_differ"}
    for name, value in metrics.items():
        assert value.dtype == torch.float64 and value.dim() == 0, (name, value.dtype, value.shape)
    assert metrics["lr"].item() == pytest.approx(1e-3) and metrics["replicas_differ"].item() == 0.0
