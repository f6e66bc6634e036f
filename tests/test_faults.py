"""FaultyWorld: every fault is observed in the step's metrics or state, deterministically."""

from __future__ import annotations

import math
import time

import pytest
import torch

import fzero
from fzero.testing import CorruptResult, Delay, FaultyWorld, GradFault
from helpers import batches, children, mlp

mse = torch.nn.functional.mse_loss


def _setup(world: int, stage: int, faults, scaler=None):
    model = mlp(torch.float32)
    faulty = FaultyWorld(fzero.SimulatedWorld(world), faults)
    units = children if stage == 3 else None
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), faulty, stage=stage, units=units,
                                   scaler=scaler, alignment=4)
    step = faulty.wrap(fzero.make_train_step(fzero.module_loss(model, mse), faulty))
    data = [faulty.split_batch(b) for b in batches(3, world, 2, torch.float32)]
    return faulty, state, step, data


def _bits_equal(a, b) -> bool:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_grad_fault_skips_the_step_bitwise(stage, value):
    faulty, state, step, data = _setup(3, stage, [GradFault(step=1, rank=2, value=value)])
    state, m0 = step(state, data[0])
    assert m0["found_inf"].item() == 0.0
    before = state
    after, m1 = step(state, data[1])
    assert m1["found_inf"].item() == 1.0
    # static scale 1: the whole state is bitwise unchanged but for the step-call counter (which
    # counts skipped steps too)
    assert int(after.calls[0]) == int(before.calls[0]) + 1
    assert _bits_equal(fzero.pytree.replace(before, calls=after.calls), after)
    _, m2 = step(after, data[2])
    assert m2["found_inf"].item() == 0.0
    (rec,) = faulty.records
    assert (rec.kind, rec.step, rec.rank, rec.index) == ("grad", 1, 2, 0)
    assert rec.op == ("all_reduce" if stage == 1 else "reduce_scatter")
    assert math.isinf(rec.after) if math.isinf(value) else math.isnan(rec.after)


def test_grad_fault_backs_off_dynamic_scale():
    faulty, state, step, data = _setup(2, 2, [GradFault(step=0, rank=0)], scaler=fzero.init_scaler(2.0**8))
    new, m = step(state, data[0])
    assert m["found_inf"].item() == 1.0 and new.scaler.scale.item() == 2.0**7
    assert all(torch.equal(a, b) for a, b in zip(new.shard.master, state.shard.master))
    assert torch.equal(new.opt.step, state.opt.step)


def test_corrupted_all_gather_is_caught_by_check_replicas():
    faulty, state, step, data = _setup(3, 2, [CorruptResult(step=1, rank=1, op="all_gather", index=5)])
    state, _ = step(state, data[0])
    fzero.replicas.check_replicas(state, faulty)
    state, _ = step(state, data[1])
    (rec,) = faulty.records
    assert (rec.kind, rec.step, rec.rank, rec.op, rec.index) == ("corrupt", 1, 1, "all_gather", 5)
    assert rec.before != rec.after
    assert bool(fzero.replicas.replicas_differ(state, faulty))
    with pytest.raises(fzero.ReplicaDivergenceError) as e:
        fzero.replicas.check_replicas(state, faulty)
    (d,) = e.value.differences
    assert d.item.startswith("params flat group 0") and d.differ == (1,) and d.agree == (0, 2)
    assert "0.weight on rank 1" in str(e.value), str(e.value)


def test_corrupted_all_reduce_changes_the_step():
    faulty, state, step, data = _setup(2, 2, [])
    clean_state, clean = step(state, data[0])
    faulty2, state2, step2, _ = _setup(2, 2, [CorruptResult(step=0, rank=0, op="all_reduce", index=1, value=123.0)])
    bad_state, bad = step2(state2, data[0])
    (rec,) = faulty2.records
    assert (rec.kind, rec.op, rec.after) == ("corrupt", "all_reduce", 123.0)
    # today the step's one all_reduce is unscale_and_clip's (fzero.scaler) [sum of squares, loss]: the loss was replaced
    assert not (_bits_equal(clean_state, bad_state) and _bits_equal(clean, bad))


def test_delay_is_observed_as_time_and_recorded():
    faulty, state, step, data = _setup(2, 2, [Delay(step=1, rank=1, seconds=0.3)])
    state, _ = step(state, data[0])
    t0 = time.perf_counter()
    state, _ = step(state, data[1])
    assert time.perf_counter() - t0 >= 0.3
    (rec,) = faulty.records
    assert (rec.kind, rec.step, rec.rank) == ("delay", 1, 1)


def test_faults_are_deterministic_and_outside_scopes_pass_through():
    faults = [GradFault(step=0, rank=1), CorruptResult(step=1, rank=0, op="all_gather")]
    runs = []
    for _ in range(2):
        faulty, state, step, data = _setup(2, 2, faults)
        assert faulty.records == [] and faulty.step == 0  # init_train_state: outside any scope
        for b in data:
            state, _ = step(state, b)
        runs.append((faulty.records, [m.clone() for m in state.shard.master]))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 2
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_invalid_faults_raise():
    w = fzero.SimulatedWorld(2)
    with pytest.raises(ValueError, match="rank"):
        FaultyWorld(w, [GradFault(step=0, rank=2)])
    with pytest.raises(ValueError, match="op"):
        FaultyWorld(w, [CorruptResult(step=0, rank=0, op="broadcast")])
    with pytest.raises(ValueError, match="inf"):
        FaultyWorld(w, [GradFault(step=0, rank=0, value=1.0)])
    faulty = FaultyWorld(w, [CorruptResult(step=0, rank=0, index=10**6)])
    with faulty.stepping(), pytest.raises(IndexError, match="out of range"):
        faulty.all_gather(torch.zeros(2, 3))
