"""The memory report against the ZeRO paper's formula and against the real state buffers."""

from __future__ import annotations

import pytest
import torch

import fzero
from helpers import children, mlp

BF16 = fzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_report_equals_zero_formula_within_padding(stage, world):
    model = mlp(sizes=(37, 101, 29, 5))  # element counts not divisible by the world sizes
    layout = fzero.layout.build_layout(model, 1, alignment=16)
    rep = fzero.memory_report(layout, fzero.adamw(), stage=stage, precision=BF16, world_size=world)
    psi = sum(p.numel() for p in model.parameters())
    assert rep.num_params == psi
    formula = fzero.memory.zero_paper_bytes(psi, stage, world)
    assert rep.total - rep.padding == pytest.approx(formula, rel=1e-12)
    # padding is small: at most one aligned shard's worth per flat group and kind
    assert 0 <= rep.padding <= 16 * world * 16 * len(layout.with_world_size(world).groups)
    # and the report is exact on the padded layout
    padded = layout.with_world_size(world).num_padded
    assert rep.total == pytest.approx(fzero.memory.zero_paper_bytes(padded, stage, world), rel=1e-12)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_report_matches_the_buffers_a_state_holds(stage, world):
    model = mlp(sizes=(37, 101, 29, 5))
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.adam(), comm, precision=BF16)
    rep = fzero.memory_report(state.layout, state.opt.optimizer, stage=stage, precision=BF16)

    def per_rank(tensors):
        return sum(t.numel() * t.element_size() for t in tensors) / comm.local_ranks

    assert rep.by_kind["params"] == per_rank(state.params)
    assert rep.by_kind["master"] == per_rank(state.shard.master)
    assert rep.by_kind["moments"] == per_rank([m for ms in state.opt.moments for m in ms])


def test_sgd_without_momentum_has_no_moments_and_fp32_defaults():
    layout = fzero.layout.build_layout(mlp(), 4)
    rep = fzero.memory_report(layout, fzero.sgd(lr=0.1), stage=2)
    assert rep.by_kind["moments"] == 0
    assert rep.by_kind["master"] == 4 * sum(g.shard_numel for g in layout.groups)
    assert rep.by_kind["params"] == 4 * layout.num_padded  # fp32 compute by default


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_held_is_what_the_state_keeps_between_steps(stage, world):
    """held + transient = the paper's model; held = the bytes of the TrainState's buffers
    (stage 3: 12 Psi / N, no 16-bit parameters or gradients between steps)."""
    model = mlp(sizes=(37, 101, 29, 5))
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.adam(), comm, stage=stage, units=children, precision=BF16)
    rep = fzero.memory_report(state.layout, state.opt.optimizer, stage=stage, precision=BF16)
    for kind in rep.by_kind:
        assert rep.held[kind] + rep.transient[kind] == rep.by_kind[kind]
    assert rep.transient["grads"] == rep.by_kind["grads"]  # gradients never outlive a step
    buffers = [*state.params, *state.shard.master, *(m for ms in state.opt.moments for m in ms)]
    assert rep.held_total == sum(t.numel() * t.element_size() for t in buffers) / comm.local_ranks
    padded = state.layout.num_padded
    expected = {1: 2 * padded + 12 * padded / world, 2: 2 * padded + 12 * padded / world, 3: 12 * padded / world}
    assert rep.held_total == pytest.approx(expected[stage])
    assert rep.held_total + rep.transient_total == pytest.approx(fzero.memory.zero_paper_bytes(padded, stage, world))
    table = fzero.memory.format_memory_table([rep])
    assert "held" in table and "in-step" in table


@pytest.mark.parametrize("stage,compiled", [(1, False), (2, False), (3, False), (2, True)])
def test_steps_leave_no_cyclic_garbage(stage, compiled):
    """A step leaves nothing that only Python's cyclic collector frees (the simulated world;
    tests/test_distributed.py checks real ranks, compiled stages included)."""
    from dist_cases import cyclic_garbage

    got = cyclic_garbage(fzero.SimulatedWorld(2), stage, compiled)
    assert got["tensors"] == 0 and got["bytes"] == 0, got


def _mixed_model() -> torch.nn.Module:
    """fp32: two Linears (64*128+128 and 128*64+64 elements), a BatchNorm1d between them (128+128: computed in fp32,
    ``keep_dtype``) and the first Linear's weight frozen (64*128)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128), torch.nn.Tanh(),
                                torch.nn.Linear(128, 64))
    model[0].weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_module_params_by_formula(stage, donate, world):
    """What the module's own parameters hold beside the state, per rank: at stages 1-2 under ``param_dtype=bf16`` each
    trainable fp32 parameter cast to bf16 keeps its fp32 original (+4 bytes per parameter, unpadded, one copy per
    process); the kept BatchNorm and an fp32 run's parameters are views of the gathered buffers (0 when steps donate;
    after a pure step the first state's whole buffer, padded); frozen parameters are shared; stage 3: nothing."""
    comm = fzero.SimulatedWorld(world)
    bf16 = fzero.MixedPrecision(param_dtype=torch.bfloat16)
    cast = 128 + 128 * 64 + 64  # trainable, fp32, computed in bf16: the first bias and the second Linear
    for precision in (bf16, fzero.MixedPrecision()):
        state = fzero.init_train_state(_mixed_model(), fzero.adamw(), comm, stage=stage, precision=precision,
                                       units=children if stage == 3 else None)
        lay = state.layout
        rep = fzero.memory_report(lay, state.opt.optimizer, stage=stage, precision=precision, comm=comm,
                                  donate=donate)
        kept = sum(g.padded_numel for g in lay.groups if g.keep_dtype)  # the BatchNorm's group, padded
        assert kept >= 256 if precision is bf16 else kept == 0  # kept groups only beside a param_dtype
        if stage == 3:
            expected = 0.0
        elif precision is bf16:
            expected = 4 * cast / world + (0 if donate else 4 * kept)
        else:  # every trainable parameter a view: after a pure step, the first state's buffers (= held params)
            expected = 0 if donate else 4 * lay.num_padded
            assert expected == (0 if donate else rep.held["params"])
        assert rep.module_params == pytest.approx(expected, rel=1e-12), (precision, rep.module_params, expected)
        assert rep.held_with_module == rep.held_total + rep.module_params
        # not the training state's: ZeRO's formula and held are as before
        assert rep.total == sum(rep.by_kind.values())
        # a pytree's tensors, or a meta module built by init=, are no module copy
        assert fzero.memory_report(lay, state.opt.optimizer, stage=stage, precision=precision, comm=comm,
                                   donate=donate, module=False).module_params == 0
    head, row = fzero.memory.format_memory_table([rep]).splitlines()[:2]
    cell = row.split()[head.split().index("module")].rstrip("*")  # MiB per rank
    assert float(cell) == pytest.approx(rep.module_params / 2**20, abs=5e-4)
