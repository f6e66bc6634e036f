"""Property-test your own model's training with fzero, in a few lines.

Three properties of a small MLP with a LayerNorm (replace ``make_model`` with
your model), each checked by hypothesis on many generated cases (world size,
width, batch split with accumulation, optimizer with parameter groups):

1. ZeRO stages 1, 2 and 3 on W simulated ranks give the parameters of plain
   training on one device (float64: equal to 1e-7, where a lost gradient shows as 1e-3);
2. a step whose gradients hold an inf on one rank is skipped: every bit of the
   state is unchanged (but ``state.calls``, which counts skipped steps too);
3. one corrupted element in one rank's all-gather is caught by
   ``fzero.replicas.check_replicas``, which names the rank (from 3 ranks on, where a
   majority tells which rank is the odd one out).

Run it as a script (a few seconds) or under pytest::

    python examples/property_test.py
    python -m pytest examples/property_test.py

Needs hypothesis (``pip install -e ".[examples]"`` or ``".[testing]"``).
"""

from __future__ import annotations

import math

import torch
import torch.utils._pytree as tp
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.testing import CorruptResult, FaultyWorld, GradFault
from fzero.testing import strategies as fst

mse = torch.nn.functional.mse_loss
D_IN, D_OUT = 3, 2


def make_model(width: int) -> torch.nn.Sequential:
    """The model under test (float64: stage and world size change only rounding)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(D_IN, width), torch.nn.Tanh(), torch.nn.LayerNorm(width), torch.nn.Linear(width, D_OUT),
    ).double()


def data(n: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, D_IN, generator=g, dtype=torch.float64),
             torch.randn(n, D_OUT, generator=g, dtype=torch.float64)) for _ in range(steps)]


def train(comm, stage, width, optimizer, split, steps=2, accum=1):
    """``steps`` steps of ZeRO ``stage`` on ``comm``; returns the state and the step."""
    model = make_model(width)
    units = (lambda name, m: "." not in name) if stage == 3 else None  # stage 3: a unit per child
    state = fzero.init_train_state(model, optimizer, comm, stage=stage, units=units)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, accum_steps=accum)
    for batch in data(split.global_batch, steps):
        state, _ = step(state, comm.split_batch(batch, micro_batches=accum))
    return state, step


def full_params(state, comm) -> list[torch.Tensor]:
    return [p[0] for p in tp.tree_leaves(fzero.full_params(state.shard, comm))]


paths = [n for n, _ in make_model(1).named_parameters()]
widths = st.integers(3, 6)  # LayerNorm over 1 or 2 features is degenerate (constant output)


@settings(max_examples=10, deadline=None)
@given(width=widths, split=fst.batch_splits(max_accum=2), optimizer=fst.optimizers(paths=paths))
def test_stages_equal_one_device(width, split, optimizer):
    one = fzero.SimulatedWorld(1)
    whole = fst.BatchSplit(1, split.global_batch)  # the same global batch on one device
    reference = full_params(train(one, 2, width, optimizer, whole)[0], one)
    comm = fzero.SimulatedWorld(split.world)
    for stage in (1, 2, 3):
        state, _ = train(comm, stage, width, optimizer, split, accum=split.accum)
        for mine, ref in zip(full_params(state, comm), reference):
            assert torch.allclose(mine, ref, rtol=1e-7, atol=1e-9), (stage, (mine - ref).abs().max())


@settings(max_examples=10, deadline=None)
@given(width=widths, world=fst.world_sizes(1, 4), stage=st.sampled_from([1, 2, 3]), data_=st.data())
def test_inf_gradient_skips_step_bitwise(width, world, stage, data_):
    rank = data_.draw(st.integers(0, world - 1))
    faulty = FaultyWorld(fzero.SimulatedWorld(world), [GradFault(step=1, rank=rank, value=math.inf)])
    state, step = train(faulty, stage, width, fzero.adamw(lr=1e-2), fst.BatchSplit(world, 2), steps=0)
    step = faulty.wrap(step)
    batches = [faulty.split_batch(b) for b in data(2 * world, 2)]
    state, _ = step(state, batches[0])
    after, metrics = step(state, batches[1])
    assert metrics["found_inf"].item() == 1.0
    # every bit unchanged but the count of step calls (state.calls: skipped steps count too)
    assert int(after.calls[0]) == int(state.calls[0]) + 1
    state = fzero.pytree.replace(state, calls=after.calls)
    assert all(torch.equal(a, b) for a, b in zip(tp.tree_leaves(state), tp.tree_leaves(after)))


@settings(max_examples=10, deadline=None)
@given(width=widths, world=fst.world_sizes(3, 5), stage=st.sampled_from([1, 2]), data_=st.data())
def test_corrupted_all_gather_is_caught(width, world, stage, data_):
    rank = data_.draw(st.integers(0, world - 1))
    index = data_.draw(st.integers(0, width * D_IN - 1))  # an element of the first weight
    faulty = FaultyWorld(fzero.SimulatedWorld(world), [CorruptResult(step=0, rank=rank, op="all_gather", index=index)])
    state, step = train(faulty, stage, width, fzero.sgd(lr=0.1), fst.BatchSplit(world, 2), steps=0)
    state, _ = faulty.wrap(step)(state, faulty.split_batch(data(2 * world, 1)[0]))
    try:
        fzero.replicas.check_replicas(state, faulty)
    except fzero.ReplicaDivergenceError as e:
        assert [d.differ for d in e.differences] == [(rank,)], e
    else:
        raise AssertionError("a corrupted all_gather went unnoticed")


if __name__ == "__main__":
    for test in (test_stages_equal_one_device, test_inf_gradient_skips_step_bitwise,
                 test_corrupted_all_gather_is_caught):
        test()
        print(f"ok  {test.__name__}")
