"""A skipped step (a non-finite gradient on some rank) leaves the state as it was given,
BatchNorm statistics included; an empty batch is refused before any collective."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as tp

import fzero
from helpers import batches

mse = torch.nn.functional.mse_loss


def bn_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _kept(state: fzero.TrainState) -> list[torch.Tensor]:
    """Every tensor of the state a skipped step must leave bitwise alone (not the scaler, which
    backs off, nor the generators, which advanced by the forward's draws as torch's do)."""
    return tp.tree_leaves((state.shard, state.opt, state.params, state.buffers))


@pytest.mark.parametrize("stage,compile", [(1, False), (2, False), (3, False), (2, True)])
def test_a_skipped_step_keeps_buffers(stage, compile):
    model = bn_mlp()
    comm = fzero.SimulatedWorld(2)
    units = dict(units=lambda name, m: name == "3") if stage == 3 else {}
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage, alignment=4, **units)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=compile)
    good, bad = [comm.split_batch(b) for b in batches(2, 2, 4, torch.float32)]
    state, m = step(state, good)
    assert m["found_inf"].item() == 0.0
    x = bad[0].clone()
    x[1, 0, 0] = float("nan")  # rank 1's forward: NaN statistics and a NaN gradient
    before = [t.clone() for t in _kept(state)]
    assert all(torch.isfinite(b).all() for b in state.buffers if b.is_floating_point())
    new, m = step(state, (x, bad[1]))
    assert m["found_inf"].item() == 1.0
    after = _kept(new)
    assert len(after) == len(before)
    for i, (a, b) in enumerate(zip(after, before)):
        assert torch.equal(a, b), f"state leaf {i} changed in a skipped step"
    # the statistics are the step's input (rank 0's after the broadcast would differ on rank 1)
    for b in new.buffers:
        assert torch.isfinite(b.double()).all()
    # and training goes on: the next finite step updates the buffers again
    newer, m = step(new, good)
    assert m["found_inf"].item() == 0.0
    assert not torch.equal(newer.buffers[0], new.buffers[0])


@pytest.mark.parametrize("accum", [1, 2])
def test_an_empty_batch_is_refused_before_any_collective(accum):
    model = bn_mlp()
    comm = fzero.comm.CountingCommunicator(fzero.SimulatedWorld(2))
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, alignment=4)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, accum_steps=accum)
    empty = comm.split_batch((torch.zeros(0, 6), torch.zeros(0, 3)), micro_batches=accum)
    lead = "2, 2" if accum == 2 else "2"
    per = "per rank and micro-batch" if accum == 2 else "per rank"
    comm.reset()
    with pytest.raises(ValueError, match=rf"batch\[0\] is empty: shape \({lead}, 0, 6\), 0 examples {per} "
                                         rf"\(dim {accum}\)"):
        step(state, empty)
    assert comm.records == []
