"""One copy of the parameters: after init_train_state the state owns them (design.md,
"Who owns the parameter memory")."""

from __future__ import annotations

import copy

import pytest
import torch

import fzero
from helpers import batches, children, mlp

mse = torch.nn.functional.mse_loss


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("stage", [1, 2])
def test_stage12_module_views_the_state_and_a_donating_step_keeps_it_current(stage):
    model = mlp(torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage)
    buffers = {_storage(p) for p in state.params}
    for n, p in model.named_parameters():
        assert _storage(p) in buffers, n  # a view of the gathered buffers, not a copy
        assert torch.equal(p, before[n]), n  # with the module's own values
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, donate=True)
    for batch in batches(3, 2, 2, torch.float32):
        state, _ = step(state, comm.split_batch(batch))
    assert {_storage(p) for p in state.params} == buffers  # gathered in place
    trained = {k: v[0] for k, v in fzero.full_params(state.shard, comm).items()}
    for n, p in model.named_parameters():
        assert torch.equal(p, trained[n]), n
        assert not torch.equal(p, before[n]), n


def test_stage12_pure_steps_leave_the_module_and_the_first_state_unchanged():
    model = mlp(torch.float32)
    comm = fzero.SimulatedWorld(2)
    first = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm)
    kept = [p.clone() for p in first.params]
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    state = first
    for batch in batches(2, 2, 2, torch.float32):
        state, _ = step(state, comm.split_batch(batch))
    assert all(torch.equal(a, b) for a, b in zip(first.params, kept))
    fzero.write_back(state, comm, model)  # points the module at the new state: no copy
    assert {_storage(p) for p in model.parameters()} <= {_storage(p) for p in state.params}
    assert all(torch.equal(a, b) for a, b in zip(first.params, kept))


def test_stage3_module_holds_no_parameters_until_write_back():
    model = mlp(torch.float32)
    reference = copy.deepcopy(model)
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=3, units=children)
    held = [p for p in model.parameters()]
    assert all(p.is_meta and isinstance(p, torch.nn.Parameter) for p in held)
    x = torch.randn(4, 6)
    with pytest.raises(RuntimeError, match=r"fzero.write_back\(state, comm, model\)"):
        model(x)
    with pytest.raises(ValueError, match="handed to a stage-3 state"):
        fzero.init_train_state(model, fzero.adamw(), comm, stage=3, units=children)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    state, _ = step(state, comm.split_batch(batches(1, 2, 2, torch.float32)[0]))
    fzero.write_back(state, comm, model)
    assert all(a is b for a, b in zip(model.parameters(), held))  # the same objects, now with memory
    assert not any(p.is_meta for p in model.parameters())
    trained = {k: v[0] for k, v in fzero.full_params(state.shard, comm).items()}
    for n, p in model.named_parameters():
        assert torch.equal(p, trained[n]), n
    reference.load_state_dict(trained)
    assert torch.equal(model(x), reference(x))


def test_frozen_parameters_are_shared_not_copied():
    model = mlp(torch.float32)
    model[0].weight.requires_grad_(False)
    state = fzero.init_train_state(model, fzero.adamw(), fzero.SimulatedWorld(2))
    assert _storage(state.shard.frozen[0]) == _storage(model[0].weight)


@pytest.mark.parametrize("stage", [1, 2])
def test_init_holds_one_model_and_one_group_of_gathered_parameters(stage):
    """init_train_state gathers the parameters group by group and hands each group's module
    parameters over at once, so the module's copy of a group is freed before the next group
    is gathered; the moments are not written before the first step (:func:`zeros_on_demand`).
    Tracked live bytes at init's peak: the module, the master and one group, where gathering
    everything before handing over held two models and the moments."""
    from fzero.testing.census import Census

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)])
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with Census({"module": list(model.parameters())}) as census:
        state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), fzero.SimulatedWorld(1), stage=stage,
                                       bucket_numel=1 << 20)
    group = max(g.padded_numel for g in state.layout.groups) * 4
    assert len(state.layout.groups) == 4
    # module + master + the group being gathered (and the master's stacking of one group)
    assert census.total_at_peak <= 2 * model_bytes + 2 * group + (1 << 20), census.table()
    # master and gathered buffers; the moments are not written (the module views the buffers)
    assert census.end_by_category.get("other", 0) <= 2 * model_bytes + (1 << 20)
    assert all(float(m.abs().sum()) == 0 for ms in state.opt.moments for m in ms)


def test_zeros_on_demand_cost_no_memory_until_written():
    from fzero.optim import zeros_on_demand

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    like = torch.empty(2, 16 << 20)  # 128 MiB of fp32, never written: no RSS
    before = rss()
    z = zeros_on_demand(like)
    assert z.shape == like.shape and z.dtype == like.dtype and z.is_contiguous()
    assert rss() - before < 16 << 20
    z[1].fill_(3.0)
    assert rss() - before > 48 << 20
    assert float(z[0].abs().max()) == 0.0 and float(z[1].min()) == 3.0
    small = zeros_on_demand(torch.empty(3, dtype=torch.float64))
    assert small.dtype == torch.float64 and torch.equal(small, torch.zeros(3, dtype=torch.float64))
