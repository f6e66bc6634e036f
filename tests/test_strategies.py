"""The public hypothesis strategies (fzero.testing.strategies): what they generate is valid
for fzero, the edge cases appear, and shrinking finds a minimal failing case of a
deliberately broken step."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

import fzero
from fzero.testing import CorruptResult, FaultyWorld, GradFault
from fzero.testing import strategies as fst
from helpers import examples


def tree_loss(params, batch):
    """A loss that touches every leaf (0-d and empty ones too): (sum of all parameters * x - y)^2."""
    x, y = batch
    total = sum(leaf.float().sum() for leaf in torch.utils._pytree.tree_leaves(params))
    return ((total * x - y) ** 2).mean()


def tree_batch(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g)


@settings(max_examples=examples(15))
@given(data=st.data(), tree=fst.param_trees(max_leaves=4), world=fst.world_sizes(1, 4), stage=st.sampled_from([1, 2]))
def test_generated_trees_optimizers_scalers_train(data, tree, world, stage):
    optimizer = data.draw(fst.optimizers(paths=tree.trainable_paths))
    scaler = data.draw(fst.scalers())
    split = data.draw(fst.batch_splits(world=world, max_accum=2))
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(tree.tree(), optimizer, comm, stage=stage, scaler=scaler,
                                   trainable=tree.trainable, alignment=data.draw(fst.alignments()))
    frozen = [s.path for s in state.layout.slots if s.group < 0]
    assert frozen == [p for p in tree.paths if not tree.trainable(p)]
    step = fzero.make_train_step(tree_loss, comm, accum_steps=split.accum)
    state, m = step(state, split.split(comm, tree_batch(split.global_batch)))
    assert m["found_inf"].item() in (0.0, 1.0)
    fzero.replicas.check_replicas(state, comm)


def test_edge_cases_are_generated():
    trees = fst.param_trees()
    assert find(trees, lambda t: () in t.shapes).shapes == ((),)  # 0-d, shrunk to one leaf
    assert any(0 in s for s in find(trees, lambda t: any(0 in s for s in t.shapes)).shapes)  # empty
    assert any(find(trees, lambda t: any(t.frozen)).frozen)
    mixed = find(trees, lambda t: len(set(t.dtypes)) == len(fst.FLOAT_DTYPES))
    assert set(mixed.dtypes) == set(fst.FLOAT_DTYPES)
    assert find(trees, lambda t: any(math.prod(s) % 2 == 1 and math.prod(s) > 1 for s in t.shapes))
    opt = find(fst.optimizers(paths=["a.0", "b.0"]), lambda o: o.num_groups == 3 and o.kind == "sgd" and o.nesterov)
    assert opt.num_groups == 3
    assert find(fst.scalers(), lambda s: s.dynamic and s.hysteresis is not None and s.min_scale is not None)
    assert find(fst.batch_splits(), lambda b: b.accum > 1 and b.world > 1).global_batch == 2 * 2 * 1
    sched = find(fst.fault_schedules(3, 4), lambda fs: {type(f) for f in fs} == {fzero.testing.GradFault,
                                                                            fzero.testing.CorruptResult,
                                                                            fzero.testing.Delay})
    assert len(sched) == 3


class DropLastRank(fzero.Communicator):
    """A deliberately broken world: from 3 ranks on, the last rank's gradient is dropped."""

    def __init__(self, world: int):
        self.inner = fzero.SimulatedWorld(world)
        self.world_size, self.local_ranks, self.ranks = world, world, self.inner.ranks

    def all_reduce(self, x, op="sum"):
        return self.inner.all_reduce(x, op)

    def all_gather(self, x):
        return self.inner.all_gather(x)

    def reduce_scatter(self, x, op="sum"):
        if self.world_size >= 3:
            x = torch.cat([x[:-1], torch.zeros_like(x[-1:])])
        return self.inner.reduce_scatter(x, op)


def _matches_one_device(world: int, tree: fst.ParamTree) -> bool:
    """Stage 2 on a broken world of ``world`` ranks vs the same global batch on one device."""
    out = []
    for comm in (DropLastRank(world), fzero.SimulatedWorld(1)):
        state = fzero.init_train_state(tree.tree(), fzero.sgd(lr=0.1), comm, trainable=tree.trainable)
        state, _ = fzero.make_train_step(tree_loss, comm)(state, comm.split_batch(tree_batch(2 * world)))
        out.append(torch.utils._pytree.tree_leaves(fzero.full_params(state.shard, comm)))
    many, one = out
    return all(torch.allclose(a[0].double(), b[0].double(), rtol=1e-2, atol=1e-3) for a, b in zip(many, one))


def test_shrinking_finds_the_minimal_broken_case():
    cases = st.tuples(fst.world_sizes(1, 6), fst.param_trees(max_leaves=3, allow_frozen=False))
    world, tree = find(cases, lambda c: not _matches_one_device(*c), settings=settings(max_examples=200, database=None))
    # the smallest world that drops a gradient, and the smallest tree: one 0-d float32 leaf
    assert world == 3
    assert tree.shapes == ((),) and tree.dtypes == (torch.float32,)


@settings(max_examples=examples(8))
@given(world=fst.world_sizes(1, 3), data=st.data())
def test_fault_schedules_are_observed(world, data):
    steps = 3
    faults = data.draw(fst.fault_schedules(world, steps, max_delay=0.001))
    tree = fst.ParamTree(((3,), (2, 2)), (torch.float32, torch.float32), seed=1)
    faulty = FaultyWorld(fzero.SimulatedWorld(world), faults)
    state = fzero.init_train_state(tree.tree(), fzero.adam(lr=0.01), faulty, alignment=1)
    step = faulty.wrap(fzero.make_train_step(tree_loss, faulty))
    for s in range(steps):
        before = state
        state, m = step(state, faulty.split_batch(tree_batch(world * 2, seed=s)))
        if any(isinstance(f, GradFault) for f in faulty.faults_at(s)):
            assert m["found_inf"].item() == 1.0
            assert all(torch.equal(a, b) for a, b in zip(before.shard.master, state.shard.master))
        corrupted = [r for r in faulty.records if r.step == s and isinstance(r.fault, CorruptResult)
                     and not (r.before == r.after or (math.isnan(r.before) and math.isnan(r.after)))]
        if corrupted and world > 1:  # one rank has no replica to disagree with
            with pytest.raises(fzero.ReplicaDivergenceError):
                fzero.replicas.check_replicas(state, faulty)
        else:
            fzero.replicas.check_replicas(state, faulty)
    assert {(r.fault.step, r.fault.rank) for r in faulty.records} <= {(f.step, f.rank) for f in faults}


def test_fzero_testing_imports_without_hypothesis():
    code = (
        "import sys; sys.modules['hypothesis'] = None\n"
        "import fzero.testing as t\n"
        "assert t.FaultyWorld and t.GatherTracker and t.run_torchrun\n"
        "try:\n    import fzero.testing.strategies\nexcept ImportError as e:\n    print('ImportError', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError" in out.stdout and "fzero[testing]" in out.stdout


def test_slow_property_tests_explore_more_in_the_long_profile(monkeypatch):
    """A test that sets its own (CI-sized) example count gets it in CI and the long profile's multiple of it
    locally, as the tests on the profiles' defaults do."""
    import helpers

    ci, long = settings.get_profile("ci").max_examples, settings.get_profile("long").max_examples
    assert long > ci
    monkeypatch.setattr(helpers, "LONG", False)
    assert helpers.examples(8) == 8
    monkeypatch.setattr(helpers, "LONG", True)
    assert helpers.examples(8) == 8 * long // ci
