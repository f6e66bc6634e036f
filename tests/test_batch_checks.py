"""The step refuses batches without the local-rank (and micro-batch) axis, naming the leaf and the fix."""

from __future__ import annotations

import pytest
import torch

import fzero
from helpers import CHEAP_COMPILE, batches, children, mlp

mse = torch.nn.functional.mse_loss


def _setup(world, **kw):
    model = mlp(torch.float32)
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm)
    return comm, state, fzero.make_train_step(fzero.module_loss(model, mse), comm, **kw)


@pytest.mark.parametrize("world,global_batch", [(4, 6), (4, 8)])
def test_global_batch_without_split_is_refused(world, global_batch):
    comm, state, step = _setup(world)
    x, y = batches(1, 1, global_batch, torch.float32)[0]
    with pytest.raises(ValueError, match=rf"batch\[0\] has shape \({global_batch}, 6\).*\[4, \.\.\.\].*comm\.split_batch\(batch\)"):
        step(state, (x, y))
    step(state, comm.split_batch((torch.cat([x, x])[:8], torch.cat([y, y])[:8])))  # split: accepted


def test_accumulation_needs_the_micro_batch_axis():
    comm, state, step = _setup(2, accum_steps=3)
    batch = batches(1, 2, 6, torch.float32)[0]
    with pytest.raises(ValueError, match=r"\[2, 3, \.\.\.\].*split_batch\(batch, micro_batches=3\)"):
        step(state, comm.split_batch(batch))  # [2, 6, ...]: dim 1 is not K
    new, m = step(state, comm.split_batch(batch, micro_batches=3))
    assert torch.isfinite(m["loss"])


def test_dict_batches_name_the_key():
    comm, state, step = _setup(2)
    with pytest.raises(ValueError, match=r"batch\['x'\] has shape \(3, 6\)"):
        step(state, {"x": torch.randn(3, 6), "y": torch.randn(2, 1, 3)})


def test_real_rank_batch_of_one_example_per_step_is_refused():
    """On a real rank (R = 1), a global batch [B, ...] would be read as one rank's one example."""

    comm, state, step = _setup(1)
    x, y = batches(1, 1, 4, torch.float32)[0]
    with pytest.raises(ValueError, match=r"\[1, \.\.\.\]"):
        step(state, (x, y))


def test_batch_check_is_free_under_compile():
    from torch._dynamo.utils import counters

    model = mlp(torch.float32)
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=CHEAP_COMPILE)
    torch._dynamo.reset()
    counters.clear()
    for b in batches(3, 2, 2, torch.float32):
        state, _ = step(state, comm.split_batch(b))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    with pytest.raises(ValueError, match=r"split_batch"):
        step(state, batches(1, 2, 2, torch.float32)[0])


def test_stage3_trains_buffers_as_stage2():
    """BatchNorm inside a unit at stage 3: statistics and parameters bitwise as at stage 2."""
    out = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))
        comm = fzero.SimulatedWorld(2)
        state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm, stage=stage, units=children)
        step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
        for b in batches(3, 2, 2, torch.float32):
            state, _ = step(state, comm.split_batch(b))
        out[stage] = state
    assert out[3].module.buffers == ("1.running_mean", "1.running_var", "1.num_batches_tracked")
    for a, b in zip(out[2].buffers, out[3].buffers):
        assert torch.equal(a, b)
    assert int(out[3].buffers[2][0]) == 3
    for a, b in zip(out[2].shard.master, out[3].shard.master):
        assert torch.equal(a, b)
