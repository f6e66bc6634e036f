"""ZeRO stage 3 on the simulated world (one shard unit per child of an MLP): equal to stage 2,
compiled, memory and communication."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch._dynamo.utils import counters

import fzero
from fzero.testing import GatherTracker
from helpers import batches, children, max_rel_err, mlp

mse = torch.nn.functional.mse_loss


def _pair(model, world, *, optimizer=None, scaler=None, precision=fzero.MixedPrecision(), trainable=None):
    comm = fzero.SimulatedWorld(world)
    kw = dict(precision=precision, trainable=trainable)
    s2 = fzero.init_train_state(model, optimizer or fzero.adamw(lr=1e-2), comm, scaler=scaler, **kw)
    s3 = fzero.init_train_state(model, optimizer or fzero.adamw(lr=1e-2), comm, scaler=scaler, stage=3,
                                units=children, **kw)
    step2 = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    step3 = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    return comm, (s2, step2), (s3, step3)


def _params(state, comm):
    return {k: v[0] for k, v in fzero.full_params(state.shard, comm, torch.float64).items()}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-6)], ids=["f64", "f32"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_stage3_equals_stage2_after_20_steps(world, dtype, tol):
    model = mlp(dtype)
    opt = fzero.adamw(lr=1e-2, weight_decay=0.1, groups=[(fzero.optim.no_weight_decay_for(model), {"weight_decay": 0.0})])
    comm, (s2, step2), (s3, step3) = _pair(model, world, optimizer=opt)
    assert s3.params == () and len(s3.layout.groups) > len(s2.layout.groups)
    for batch in batches(20, world, 2, dtype):
        b = comm.split_batch(batch)
        s2, m2 = step2(s2, b)
        s3, m3 = step3(s3, b)
        assert abs(m2["loss"].item() - m3["loss"].item()) <= tol * abs(m2["loss"].item()) + 1e-30
    p2, p3 = _params(s2, comm), _params(s3, comm)
    for k in p2:
        assert max_rel_err(p3[k], p2[k]) <= tol, k
    assert int(s3.opt.step) == 20


def test_stage3_with_scaler_skips_frozen_and_low_precision():
    """Dynamic fp16 loss scale with an injected inf, a frozen layer, bf16 compute and
    bf16 gradient communication: stage 3 follows stage 2 step for step."""
    model = mlp(torch.float32)
    model[0].requires_grad_(False)
    precision = fzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    frozen_before = model[0].weight.detach().clone()  # stage 3 takes it (sharded) too
    comm, (s2, step2), (s3, step3) = _pair(
        model, 2, scaler=fzero.init_scaler(2.0**8, growth_interval=3), precision=precision
    )
    found = []
    for i, (x, y) in enumerate(batches(10, 2, 2, torch.float32)):
        if i == 4:
            x = x.clone()
            x[3, 0] = math.nan  # rank 1 only (an inf would be absorbed: frozen Linear, then tanh)
        b = comm.split_batch((x, y))
        s2, m2 = step2(s2, b)
        s3, m3 = step3(s3, b)
        assert m2["found_inf"].item() == m3["found_inf"].item()
        assert m2["scale"].item() == m3["scale"].item()
        found.append(m3["found_inf"].item())
    assert found[4] == 1.0 and sum(found) == 1.0
    p2, p3 = _params(s2, comm), _params(s3, comm)
    for k in p2:
        assert max_rel_err(p3[k], p2[k]) <= 1e-6, k
    assert torch.equal(p3["0.weight"].float(), frozen_before)


def test_stage3_compiled_equals_eager_without_recompiles():
    model = mlp(torch.float32)
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=3, units=children,
                                   scaler=fzero.init_scaler(2.0**8, growth_interval=2))
    eager = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    torch._dynamo.reset()
    counters.clear()
    compiled = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=True)
    se, sc = state, state
    scales = set()
    for i, (x, y) in enumerate(batches(10, 2, 2, torch.float32)):
        if i == 6:
            x = x.clone()
            x[0, 0] = math.nan
        b = comm.split_batch((x, y))
        se, me = eager(se, b)
        sc, mc = compiled(sc, b)
        scales.add(mc["scale"].item())
        assert me["found_inf"].item() == mc["found_inf"].item()
        for a, e in zip(sc.shard.master, se.shard.master):
            assert max_rel_err(a, e) <= 1e-6
    assert len(scales) >= 3
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"] and not counters["graph_break"]


def test_stage3_donating_equals_pure():
    model = mlp(torch.float32)
    comm = fzero.SimulatedWorld(2)
    # a stage-3 state takes the module's parameters (they move to meta): one model per state
    pure = fzero.init_train_state(copy.deepcopy(model), fzero.adamw(lr=1e-2), comm, stage=3, units=children)
    donated = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=3, units=children)
    sp = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    sd = fzero.make_train_step(fzero.module_loss(model, mse), comm, donate=True)
    for batch in batches(4, 2, 2, torch.float32):
        b = comm.split_batch(batch)
        pure, _ = sp(pure, b)
        donated, _ = sd(donated, b)
    for a, b_ in zip(pure.shard.master, donated.shard.master):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("world", [2, 4])
def test_stage3_communication_is_two_gathers_and_one_reduce_scatter(world):
    model = mlp(torch.float32)
    counting = fzero.comm.CountingCommunicator(fzero.SimulatedWorld(world))
    state = fzero.init_train_state(model, fzero.adamw(), counting, stage=3, units=children)
    step = fzero.make_train_step(fzero.module_loss(model, mse), counting)
    counting.reset()
    step(state, counting.split_batch(batches(1, world, 2, torch.float32)[0]))
    psi = state.layout.num_padded
    frac = (world - 1) / world
    gathers = counting.totals(["all_gather"])
    scatters = counting.totals(["reduce_scatter"])
    # The simulated world runs each local rank's forward and backward in turn, and each rank
    # gathers its units for itself: W all-gathers where W real ranks run one together. Per
    # real rank: every unit gathered in forward and again in backward, but the last two, which
    # are kept from their forward to their backward; every unit reduce-scattered once.
    kept = [g for g in state.layout.groups if g.bucket >= len(state.module.units) - 1]
    psi_kept = sum(g.padded_numel for g in kept)
    assert gathers["moved"] == pytest.approx(world * (2 * psi - psi_kept) * frac)
    assert gathers["calls"] == world * (2 * len(state.layout.groups) - len(kept))
    assert scatters["moved"] == pytest.approx(psi * frac)
    assert scatters["calls"] == len(state.layout.groups)
    # beyond them, only the step's scalar all-reduce: sum of squares, loss, and one "had a
    # gradient" flag per trainable parameter (make_train_step(unused="skip"))
    assert counting.totals(["all_reduce"])["elements"] == 2 + len(state.layout.trainable_slots)
    assert counting.totals(["all_reduce"])["calls"] == 1


@pytest.mark.parametrize("world", [1, 2, 3])
def test_stage3_root_travels_with_the_first_unit(world):
    """The root's parameters are gathered in the first unit's collective and its gradient is
    reduced in the first unit's: per rank U gathers in forward, U - 2 in backward, U reductions
    for U units and a root; the result is bitwise stage 2's."""
    torch.manual_seed(0)
    block = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())  # noqa: E731
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), block(), block(), block(), torch.nn.Linear(8, 3))
    units = lambda name, m: name in ("1", "2", "3")  # noqa: E731
    counting = fzero.comm.CountingCommunicator(fzero.SimulatedWorld(world))
    s2 = fzero.init_train_state(model, fzero.adamw(lr=1e-2), fzero.SimulatedWorld(world), stage=2, units=units)
    s3 = fzero.init_train_state(model, fzero.adamw(lr=1e-2), counting, stage=3, units=units)
    step3 = fzero.make_train_step(fzero.module_loss(model, mse), counting)
    step2 = fzero.make_train_step(fzero.module_loss(model, mse), fzero.SimulatedWorld(world))
    for batch in batches(3, world, 2, torch.float32, d_in=4):
        counting.reset()
        s3, _ = step3(s3, counting.split_batch(batch))
        s2, _ = step2(s2, counting.split_batch(batch))
        assert counting.totals(["all_gather"])["calls"] == world * (3 + 1)
        assert counting.totals(["reduce_scatter"])["calls"] == 3
    assert all(torch.equal(a, b) for a, b in zip(s3.shard.master, s2.shard.master))


def test_stage3_holds_at_most_two_units_of_gathered_parameters():
    """An 8-block model, one unit per block: the peak of live gathered parameters is the unit
    running and the next one, prefetched."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(8)]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(64, 4))
    tracker = GatherTracker(fzero.SimulatedWorld(2))
    state = fzero.init_train_state(model, fzero.adamw(), tracker, stage=3, units=children, alignment=1)
    step = fzero.make_train_step(fzero.module_loss(model, mse), tracker)
    tracker.reset_peak()
    x = torch.randn(2, 3, 64)
    state, _ = step(state, (x, torch.randn(2, 3, 4)))
    unit_bytes = max(
        sum(g.padded_numel * 4 for g in state.layout.groups if g.bucket == b)
        for b in range(1, len(state.module.units) + 1)
    )
    total = state.layout.num_padded * 4
    assert not any(g.bucket == 0 for g in state.layout.groups)  # every parameter is in a unit
    assert tracker.peak_bytes <= 2 * unit_bytes, (tracker.peak_bytes, unit_bytes)
    assert tracker.peak_bytes < total / 3
    assert tracker.live_bytes == 0  # nothing gathered survives the step


def test_stage3_state_memory_is_sharded():
    model = mlp(torch.float32, sizes=(37, 101, 29, 5))
    comm = fzero.SimulatedWorld(4)
    bf16 = fzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    state = fzero.init_train_state(model, fzero.adam(), comm, stage=3, units=children, precision=bf16)
    rep = fzero.memory_report(state.layout, state.opt.optimizer, stage=3, precision=bf16)
    held = sum(m.numel() * m.element_size() for m in state.shard.master)
    held += sum(m.numel() * m.element_size() for ms in state.opt.moments for m in ms)
    assert held / comm.local_ranks == rep.by_kind["master"] + rep.by_kind["moments"]
    psi = sum(p.numel() for p in model.parameters())
    assert rep.total - rep.padding == pytest.approx(16 * psi / 4)


def test_stage3_needs_units_and_a_stage3_state():
    model = mlp()
    comm = fzero.SimulatedWorld(2)
    with pytest.raises(TypeError, match="needs the module"):
        fzero.make_train_step(lambda p, b: mse(p["0.weight"].sum(), b[1].sum()), comm, stage=3)
    with pytest.raises(ValueError, match="stage 3 needs the model's shard units"):
        fzero.init_train_state(model, fzero.adamw(), comm, stage=3)
    s2 = fzero.init_train_state(model, fzero.adamw(), comm, units=children)
    with pytest.raises(ValueError, match="stage=3"):
        fzero.make_train_step(fzero.module_loss(model, mse), comm, stage=3)(
            s2, comm.split_batch(batches(1, 2, 2, torch.float32)[0]))
    plain = fzero.init_train_state(model, fzero.adamw(), comm, stage=3, units=children)
    without_units = dataclasses.replace(plain, module=dataclasses.replace(plain.module, units=()))
    with pytest.raises(ValueError, match="no shard units"):
        fzero.make_train_step(fzero.module_loss(model, mse), comm)(
            without_units, comm.split_batch(batches(1, 2, 2, torch.float32)[0]))


def test_stages_share_the_units_layout():
    model = mlp()
    comm = fzero.SimulatedWorld(2)
    a = fzero.init_train_state(model, fzero.adamw(), comm, units=children)
    b = fzero.init_train_state(model, fzero.adamw(), comm, stage=3, units=children)
    assert a.layout == b.layout  # stage 1-2 with units lay out exactly like stage 3
    assert b.module.units == ("0", "2", "3", "5")  # the Tanh children have no parameters
    assert len({g.bucket for g in b.layout.groups}) == 4


def _grouped_model(kind):
    torch.manual_seed(0)
    if kind == "one":  # one unit, nothing in the root: one flat group
        return torch.nn.Sequential(torch.nn.Linear(7, 5)), fzero.adamw()
    if kind == "two":
        return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)), fzero.adamw()
    if kind == "mixed":  # a float64 unit and a float32 unit: two master dtypes
        return torch.nn.Sequential(torch.nn.Linear(7, 5).double(), torch.nn.Linear(5, 3)), fzero.adamw()
    model = mlp(torch.float32, sizes=(7, 13, 5, 3))
    return model, fzero.adamw(groups=[(fzero.optim.no_weight_decay_for(model), {"weight_decay": 0.0})])


@pytest.mark.parametrize("kind,groups", [("one", 1), ("two", 2), ("mixed", 2), ("many", 7)])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("reduce_dtype", [None, torch.bfloat16])
def test_one_collective_for_all_groups_equals_one_per_group(world, reduce_dtype, kind, groups):
    """What a compiled stage-3 step uses: one all_gather and one reduce_scatter for every flat
    group at once give bitwise what one collective per group gives (groups of two master
    dtypes reduce one by one)."""
    from fzero.layout import FlatGrads

    model, opt = _grouped_model(kind)
    comm = fzero.comm.CountingCommunicator(fzero.SimulatedWorld(world))
    state = fzero.init_train_state(model, opt, comm, stage=3, units=children, alignment=1)
    lay = state.layout
    assert len(lay.groups) == groups
    comm.reset()
    at_once = fzero.all_gather_params(state.shard, comm, torch.bfloat16)
    assert [r.op for r in comm.records] == ["all_gather"]
    reference = [fzero.all_gather_params(state.shard, comm, torch.bfloat16, groups=(grp,))[0] for grp in lay.groups]
    assert len(at_once) == len(reference) == groups
    for a, b in zip(at_once, reference):
        assert torch.equal(a, b)
    g = torch.Generator().manual_seed(0)
    flats = [torch.randn(world, grp.padded_numel, generator=g, dtype=grp.dtype) for grp in lay.groups]
    comm.reset()
    mine = fzero.reduce_scatter_grads(state.shard, FlatGrads(lay.groups, flats), comm, reduce_dtype=reduce_dtype)
    one_dtype = len({reduce_dtype or grp.master_dtype for grp in lay.groups}) == 1
    assert [r.op for r in comm.records] == ["reduce_scatter"] * (1 if one_dtype else groups)
    assert len(mine) == groups
    for grp, f, m in zip(lay.groups, flats, mine):
        (ref,) = fzero.reduce_scatter_grads(state.shard, FlatGrads((grp,), (f,)), comm, reduce_dtype=reduce_dtype)
        assert m.dtype == ref.dtype and torch.equal(m, ref)


def test_fp16_reduction_does_not_overflow():
    comm = fzero.SimulatedWorld(2)
    shard = fzero.init_shard({"w": torch.zeros(8)}, comm, alignment=1)
    grads = {"w": torch.full((2, 8), 40000.0, dtype=torch.float16)}
    (out,) = fzero.reduce_scatter_grads(shard, grads, comm, reduce_dtype=torch.float16)
    assert torch.all(out == 40000.0)


def test_gathering_at_once_checks_the_world():
    state = fzero.init_train_state(mlp(), fzero.adamw(), fzero.SimulatedWorld(2), stage=3, units=children)
    with pytest.raises(ValueError, match="world size is 3"):
        fzero.all_gather_params(state.shard, fzero.SimulatedWorld(3), torch.float32)
