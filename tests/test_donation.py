"""Donated vs pure steps, consumed states, and a compiled step with changing values."""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

import fzero
from helpers import CHEAP_COMPILE, batches, mlp

mse = torch.nn.functional.mse_loss


def _leaves(state):
    return torch.utils._pytree.tree_leaves(state)


def _run(donate, compile, steps=6, poison_at=(3,), stage=2, optimizer=None):
    comm = fzero.SimulatedWorld(2)
    model = mlp()
    state = fzero.init_train_state(
        model, optimizer or fzero.adamw(lr=1e-2), comm, stage=stage, scaler=fzero.init_scaler(2.0**8, growth_interval=2)
    )
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, donate=donate, compile=compile)
    history = []
    for i, (x, y) in enumerate(batches(steps, 2, 2, torch.float32)):
        if i in poison_at:
            x = x.clone()
            x[0, 0] = math.inf
        state, m = step(state, comm.split_batch((x, y)))
        history.append(m["found_inf"].item())
    return state, history


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_donated_and_pure_steps_are_bitwise_equal(compile, opt):
    optimizer = fzero.adamw(lr=1e-2) if opt == "adamw" else fzero.sgd(lr=0.05, momentum=0.9)
    pure, hp = _run(False, compile, optimizer=optimizer)
    donated, hd = _run(True, compile, optimizer=optimizer)
    assert hp == hd and 1.0 in hp
    for a, b in zip(_leaves(pure), _leaves(donated)):
        assert torch.equal(a, b)


def test_pure_step_leaves_its_input_untouched():
    comm = fzero.SimulatedWorld(2)
    model = mlp()
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    state, _ = step(state, comm.split_batch(batches(1, 2, 2, torch.float32)[0]))  # non-zero moments
    snapshot = [t.clone() for t in _leaves(state)]
    new, _ = step(state, comm.split_batch(batches(2, 2, 2, torch.float32)[1]))
    for t, s in zip(_leaves(state), snapshot):
        assert torch.equal(t, s)
    assert not all(torch.equal(a, b) for a, b in zip(state.shard.master, new.shard.master))
    step(state, comm.split_batch(batches(2, 2, 2, torch.float32)[1]))  # still valid input


def test_donated_step_reuses_the_buffers_and_consumes_its_input():
    comm = fzero.SimulatedWorld(2)
    model = mlp()
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, donate=True)
    ptrs = [m.data_ptr() for m in state.shard.master] + [m.data_ptr() for ms in state.opt.moments for m in ms]
    old = state
    state, _ = step(state, comm.split_batch(batches(1, 2, 2, torch.float32)[0]))
    new_ptrs = [m.data_ptr() for m in state.shard.master] + [m.data_ptr() for ms in state.opt.moments for m in ms]
    assert new_ptrs == ptrs  # updated in place: same storage
    with pytest.raises(ValueError, match="consumed"):
        step(old, comm.split_batch(batches(1, 2, 2, torch.float32)[0]))
    with pytest.raises(ValueError, match="consumed"):
        fzero.full_params(old.shard, comm)
    assert all(m.numel() == 0 for m in old.shard.master)  # never garbage: empty
    state, _ = step(state, comm.split_batch(batches(1, 2, 2, torch.float32)[0]))  # the new one works


@pytest.mark.parametrize("donate", [False, True])
def test_compiled_step_never_recompiles_over_50_steps(donate):
    """Changing lr (a schedule), a changing loss scale and skipped steps: 1 graph, 0 recompiles."""
    comm = fzero.SimulatedWorld(2)
    model = mlp()
    state = fzero.init_train_state(
        model, fzero.adamw(lr=1e-2), comm, scaler=fzero.init_scaler(2.0**8, growth_interval=3)
    )
    torch._dynamo.reset()
    counters.clear()
    # dynamo's guards are the subject (helpers.CHEAP_COMPILE); inductor's donated graph: the bitwise test above
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, donate=donate, compile=CHEAP_COMPILE)
    scales, lrs, skipped = set(), set(), 0
    for i, (x, y) in enumerate(batches(50, 2, 2, torch.float32)):
        lr = 1e-2 * 0.5 * (1 + math.cos(math.pi * i / 50))  # cosine schedule
        state = fzero.pytree.replace(state, opt=fzero.optim.set_hyperparams(state.opt, lr=lr))
        if i % 7 == 5:
            x = x.clone()
            x[1, 1] = math.nan
        state, m = step(state, comm.split_batch((x, y)))
        scales.add(m["scale"].item())
        lrs.add(round(state.opt.hyper[0]["lr"].item(), 12))
        skipped += int(m["found_inf"].item())
    assert skipped == 7 and len(scales) > 2 and len(lrs) == 50
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"] and not counters["graph_break"]
    assert int(state.opt.step) == 50 - 7


def test_compiled_donating_step_on_one_rank_never_aliases_params_and_master():
    """With W=1 an all-gather must still return a new buffer: gathered params aliasing the
    master shard made the compiled donating step fail on its second call."""
    comm = fzero.SimulatedWorld(1)
    model = mlp()
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm)
    assert all(p.data_ptr() != m.data_ptr() for p, m in zip(state.params, state.shard.master))
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, donate=True, compile=True)
    losses = []
    for batch in batches(4, 1, 4, torch.float32):
        state, m = step(state, comm.split_batch(batch))
        losses.append(m["loss"].item())
        assert all(p.data_ptr() != q.data_ptr() for p, q in zip(state.params, state.shard.master))
    assert all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_donating_steps_gather_into_the_buffers_the_module_views(compile):
    """A donating step, eager or compiled, writes the new parameters into the gathered buffers it
    was given: the same storage after every step, so the module's parameters (views of them)
    follow the training and no second parameter-sized buffer outlives a step (a compiled step
    returned new buffers, and the module kept the first ones alive beside them)."""
    comm = fzero.SimulatedWorld(1)
    model = mlp()
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, donate=True, compile=compile)
    ptrs = [p.data_ptr() for p in state.params]
    for batch in batches(3, 1, 4, torch.float32):
        state, _ = step(state, comm.split_batch(batch))
        assert [p.data_ptr() for p in state.params] == ptrs
    gathered = fzero.full_params(state.shard, comm)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), gathered[name][0]), name


def test_each_compiled_step_has_its_own_graph_cache():
    """Steps made by separate ``make_train_step`` calls in one process compile once each and
    never recompile one another's entries (dynamo keys its cache on the code object, which the
    steps shared: the second recompiled, the ninth hit the recompile limit, a hard error with
    ``fullgraph=True``)."""
    torch._dynamo.reset()
    counters.clear()
    comm = fzero.SimulatedWorld(1)
    for donate in (False, True, False):
        model = mlp()
        state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm)
        step = fzero.make_train_step(fzero.module_loss(model, mse), comm, donate=donate, compile=CHEAP_COMPILE)
        for batch in batches(2, 1, 4, torch.float32):
            state, _ = step(state, comm.split_batch(batch))
    assert counters["stats"]["unique_graphs"] == 3
    assert not counters["recompiles"]
