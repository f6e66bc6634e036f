"""Stages 1-2: gradient buckets reduced while backward runs (fzero.buckets).

* the reductions of the last layers' buckets are issued before backward reaches the first
  layer (an instrumented communicator records the collectives; a tensor hook on the first
  layer's output marks how far backward has come);
* buckets are launched in one fixed order whatever order backward completes them in, and a
  bucket some rank's backward never reaches is launched with zeros in its turn: the same
  collectives in the same order on every rank;
* every bucketing gives bitwise the same training as one bucket (stages 1 and 2,
  accumulation, deferred reduction, 16-bit reduction), equal to torch.optim on the
  averaged gradient.
"""

from __future__ import annotations

import pytest
import torch

import dist_cases as cases
import fzero
from fzero.buckets import buckets_of, size_buckets
from helpers import Mark, branchy_reference, deep_mlp, is_grad_reduction, max_rel_err
from helpers import overlap_data as data

mse = torch.nn.functional.mse_loss


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [1, 2])
def test_reductions_issued_before_backward_reaches_the_first_layer(stage, world):
    counting = fzero.comm.CountingCommunicator(fzero.SimulatedWorld(world))
    marks: list[int] = []
    model = deep_mlp(Mark(counting, marks))
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), counting, stage=stage, bucket_numel=100)
    buckets = [b for b in buckets_of(state.layout) if b]
    # each weight (at least 100 elements: a bucket of its own) and each bias
    assert len(buckets) == 10
    step = fzero.make_train_step(fzero.module_loss(model, mse), counting)
    x, y = data(1, world)[0]
    counting.reset()
    step(state, counting.split_batch((x, y)))
    ops = [r.op for r in counting.records]
    reductions = [i for i, r in enumerate(counting.records) if is_grad_reduction(r, state.layout)]
    assert len(reductions) == 10, ops
    # the last rank's backward launches the buckets (a simulated world waits for every rank's part)
    before = [i for i in reductions if i < marks[-1]]
    # the eight buckets after the first Linear are on their way before backward reaches it
    assert len(before) == 8, (marks, reductions, ops)


def test_launch_order_is_fixed_whatever_order_backward_completes_buckets():
    """A model whose registration order is not its backward order: the buckets wait for their
    turn (reverse registration order), so every rank issues the same sequence."""

    class Reversed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.head = torch.nn.Linear(16, 4, dtype=torch.float64)   # used last, registered first
            self.body = torch.nn.Linear(16, 16, dtype=torch.float64)
            self.stem = torch.nn.Linear(8, 16, dtype=torch.float64)   # used first, registered last

        def forward(self, x):
            return self.head(torch.tanh(self.body(torch.tanh(self.stem(x)))))

    results = []
    for bucket_numel in (10**9, 1):
        counting = fzero.comm.CountingCommunicator(fzero.SimulatedWorld(2))
        model = Reversed()
        state = fzero.init_train_state(model, fzero.sgd(lr=0.1, momentum=0.9), counting, bucket_numel=bucket_numel)
        step = fzero.make_train_step(fzero.module_loss(model, mse), counting)
        for x, y in data(3, 2):
            counting.reset()
            state, _ = step(state, counting.split_batch((x, y)))
        sizes = [r.elements for r in counting.records if is_grad_reduction(r, state.layout)]
        results.append((sizes, fzero.full_params(state.shard, counting)))
    one, many = results
    # reverse registration order: stem's bias, stem's weight, body's bias, ... (padded to 16 x 2)
    want = [g.padded_numel for g in reversed(
        fzero.init_train_state(Reversed(), fzero.sgd(lr=0.1), fzero.SimulatedWorld(2), bucket_numel=1).layout.groups)]
    assert many[0] == want
    for k in one[1]:
        assert torch.equal(one[1][k], many[1][k]), k


@pytest.mark.parametrize("stage", [1, 2])
def test_bucket_unused_on_some_ranks_is_reduced_in_turn(stage):
    """Rank 0 takes a branch rank 1 skips (the same case runs on gloo in test_distributed)."""
    got = cases.branchy(fzero.SimulatedWorld(2), stage)
    want = branchy_reference(cases.branchy_batches(2), 2)
    for k, v in want.items():
        assert max_rel_err(got[k], v.detach()) < 1e-12, k


def train_bucketed(stage, accum, defer, world, bucket_numel, clip_norm=None):
    model = deep_mlp(dtype=torch.float32)
    comm = fzero.SimulatedWorld(world)
    opt = fzero.adamw(lr=1e-2, groups=[(fzero.optim.no_weight_decay_for(model), {"weight_decay": 0.0})])
    state = fzero.init_train_state(model, opt, comm, stage=stage, bucket_numel=bucket_numel)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, accum_steps=accum,
                                 defer_reduce=defer, clip_norm=clip_norm)
    for x, y in data(3, world, accum, torch.float32):
        state, metrics = step(state, comm.split_batch((x, y), micro_batches=accum))
    return len(state.layout.groups), fzero.full_params(state.shard, comm), metrics


@pytest.mark.parametrize("stage,accum,defer", [(1, 1, False), (1, 3, False), (2, 1, False), (2, 3, False), (2, 3, True)])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_bucketing_trains_bitwise_alike(stage, accum, defer, world):
    got = [train_bucketed(stage, accum, defer, world, n) for n in (10**9, 300, 1)]
    assert got[0][0] == 2 and got[1][0] > 2 and got[2][0] > got[1][0]
    for _, params, metrics in got[1:]:
        for k in params:
            assert torch.equal(params[k], got[0][1][k]), k
        assert torch.equal(metrics["loss"], got[0][2]["loss"])


@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_across_buckets(stage):
    """The global norm sums per-flat-group norms: another bucketing rounds it differently in
    fp32's last bits, and the clipped step follows within that rounding."""
    one = train_bucketed(stage, 1, False, 2, 10**9, clip_norm=0.05)
    many = train_bucketed(stage, 1, False, 2, 1, clip_norm=0.05)
    assert many[2]["grad_norm"] > 0.05  # clipping was active
    assert max_rel_err(many[2]["grad_norm"], one[2]["grad_norm"]) < 1e-6
    for k in one[1]:
        assert max_rel_err(many[1][k], one[1][k]) < 1e-5, k


def test_bucketed_stage2_equals_torch_adamw_float64():
    world = 3
    batches = data(4, world)
    model = deep_mlp()
    ref = deep_mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches:
        opt.zero_grad()
        sum(mse(ref(xr), yr) for xr, yr in zip(x.chunk(world), y.chunk(world))).div(world).backward()
        opt.step()
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2, weight_decay=0.1), comm, bucket_numel=100)
    assert len(state.layout.groups) >= 5
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    for x, y in batches:
        state, _ = step(state, comm.split_batch((x, y)))
    got = fzero.full_params(state.shard, comm)
    for k, v in ref.named_parameters():
        assert max_rel_err(got[k][1], v.detach()) < 1e-12, k


def test_bf16_reduction_in_buckets_equals_one_bucket():
    """16-bit reductions (FSDP's divide factors) bucket by bucket give the same bits."""
    world = 4
    batches = data(2, world, 1, torch.float32)
    out = []
    for bucket_numel in (10**9, 1):
        model = deep_mlp(dtype=torch.float32)
        comm = fzero.SimulatedWorld(world)
        precision = fzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, precision=precision,
                                       bucket_numel=bucket_numel)
        step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
        for x, y in batches:
            state, _ = step(state, comm.split_batch((x, y)))
        out.append(fzero.full_params(state.shard, comm))
    for k in out[0]:
        assert torch.equal(out[0][k], out[1][k]), k


def test_size_buckets_cuts_in_reverse_registration_order():
    model = deep_mlp(width=8, depth=2)  # Linear(8,8), Linear(8,8), Linear(8,4)
    assert size_buckets(model, 10**6) == {n: 0 for n, _ in model.named_parameters()}
    # from the end: 4.bias 4, 4.weight 32, 2.bias 8 -> 44 >= 40 closes bucket; 2.weight 64 alone;
    # 0.bias 8; 0.weight 64 >= 40 does not join an open bucket: alone; numbered from the front
    assert size_buckets(model, 40) == {
        "0.weight": 0, "0.bias": 1, "2.weight": 2, "2.bias": 3, "4.weight": 3, "4.bias": 3,
    }
    assert size_buckets(model, 65) == {  # 4.*, 2.bias: 44; 2.weight joins (64 < 65): 108; 0.*
        "0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": 1, "4.weight": 1, "4.bias": 1,
    }
    # 4.bias 4, then 4.weight 32 >= 30 alone; 2.bias 8, then 2.weight 64 alone; 0.bias, 0.weight
    assert size_buckets(model, 30) == {
        "0.weight": 0, "0.bias": 1, "2.weight": 2, "2.bias": 3, "4.weight": 4, "4.bias": 5,
    }
    assert sorted(size_buckets(model, 1).values()) == list(range(6))


def test_bucket_numel_errors():
    model = deep_mlp()
    with pytest.raises(ValueError, match="bucket_numel must be a positive int"):
        fzero.init_train_state(model, fzero.adamw(), fzero.SimulatedWorld(2), bucket_numel=0)
    with pytest.raises(ValueError, match="shard units are the buckets"):
        fzero.init_train_state(model, fzero.adamw(), fzero.SimulatedWorld(2), stage=3,
                               units=(torch.nn.Linear,), bucket_numel=100)


def test_default_bucket_size_follows_the_model():
    """Small models: buckets of MIN_BUCKET_NUMEL elements; above SMALL_MODEL_NUMEL trainable elements, of
    LARGE_BUCKET_NUMEL."""
    from fzero.buckets import LARGE_BUCKET_NUMEL, MIN_BUCKET_NUMEL, SMALL_MODEL_NUMEL

    small = deep_mlp()
    assert sum(p.numel() for p in small.parameters()) < MIN_BUCKET_NUMEL
    assert set(size_buckets(small).values()) == {0}
    # 8 parameters of a quarter bucket each: two buckets, in registration order
    params = {f"p{i}": torch.zeros(MIN_BUCKET_NUMEL // 4) for i in range(8)}
    assert size_buckets(params) == {f"p{i}": i // 4 for i in range(8)}
    # meta tensors (only sizes count): at SMALL_MODEL_NUMEL still small buckets, one element more large ones
    n = SMALL_MODEL_NUMEL // MIN_BUCKET_NUMEL
    at = {f"p{i:03d}": torch.empty(MIN_BUCKET_NUMEL, device="meta") for i in range(n)}
    assert size_buckets(at) == {f"p{i:03d}": i for i in range(n)}
    per = LARGE_BUCKET_NUMEL // MIN_BUCKET_NUMEL
    above = {**at, "z": torch.empty(1, device="meta")}
    assert size_buckets(above) == {**{f"p{i:03d}": i // per for i in range(n)}, "z": (n - 1) // per}
    # frozen parameters do not count
    assert size_buckets(above, trainable=lambda p: p != "z") == {**{f"p{i:03d}": i for i in range(n)}, "z": 0}


@pytest.mark.parametrize("world", [1, 2])
def test_a_lone_parameter_bucket_reduces_autograds_gradient_itself(world, monkeypatch):
    """On a real rank (one local rank) a bucket holding one parameter that fills its flat group
    exactly reduces the gradient autograd made, with no bucket buffer (an embedding's or an
    output layer's: the largest gradients of a language model); a padded bucket, or a
    simulated world's rows, copy into a buffer. Same bits either way."""
    from fzero.buckets import BufferPool

    taken = []
    take = BufferPool.take
    monkeypatch.setattr(BufferPool, "take", lambda self, n, *a: taken.append(n) or take(self, n, *a))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Tanh(), torch.nn.Linear(32, 7))
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, bucket_numel=1)
    padded = {g.padded_numel: bool(g.padding) for g in state.layout.groups}
    assert len(state.layout.groups) == 3 and sum(padded.values()) == 1  # 2.bias (7 -> padded)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    batches = [(torch.randn(4 * world, 16), torch.randn(4 * world, 7)) for _ in range(2)]
    for x, y in batches:
        state, _ = step(state, comm.split_batch((x, y)))
    if world == 1:
        assert sorted(set(taken)) == [n for n, pad in padded.items() if pad]
    else:
        assert sorted(set(taken)) == sorted(world * n for n in padded)
    ref = trained_in_one_bucket(world, batches)
    got = fzero.full_params(state.shard, comm)
    for k in got:
        assert torch.equal(got[k], ref[k]), k


def trained_in_one_bucket(world: int, batches) -> dict:
    """The same training as one bucket (a buffer for everything), from the same start."""
    torch.manual_seed(0)
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Tanh(), torch.nn.Linear(32, 7))
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(fresh, fzero.adamw(lr=1e-2), comm, bucket_numel=10**9)
    step = fzero.make_train_step(fzero.module_loss(fresh, mse), comm)
    for x, y in batches:
        state, _ = step(state, comm.split_batch((x, y)))
    return fzero.full_params(state.shard, comm)
