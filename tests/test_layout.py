"""The flat layout: shard sizes, padding, packing order, and the data movement
between parameters/gradients and shards, checked against independent
references built with plain torch ops (torch.cat / torch.chunk / mean) over the
original tensors.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from hypothesis import given

import fzero
from fzero.layout import flatten_group, flatten_one
from fzero.testing.strategies import LayoutCase, layout_cases

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
MASTER = {F16: F32, BF16: F32, F32: F32, F64: F64}
INT_VIEW = {F16: torch.int16, BF16: torch.int16, F32: torch.int32, F64: torch.int64}


# --------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a floating tensor (for bitwise comparisons)."""
    return t.contiguous().view(INT_VIEW[t.dtype])


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b)), f"{what}: not bitwise equal"


def ref_groups(dtypes: list[torch.dtype]) -> list[tuple[torch.dtype, list[int]]]:
    """One group per distinct dtype, in first-appearance order; members in tree order."""
    order: dict[torch.dtype, list[int]] = {}
    for i, d in enumerate(dtypes):
        order.setdefault(d, []).append(i)
    return list(order.items())


def ref_padded(numel: int, world: int, alignment: int) -> int:
    """The smallest multiple of world * alignment that holds numel elements (at least one shard)."""
    unit = world * alignment
    return max(1, math.ceil(numel / unit)) * unit


def ref_flat(tensors: list[torch.Tensor], dtype: torch.dtype, padded: int) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    return torch.cat([flat, torch.zeros(padded - flat.numel(), dtype=dtype)])


def full_buffer(shard_rows: torch.Tensor) -> torch.Tensor:
    """A [W, n] tensor of per-rank shards joined into the [W*n] buffer they partition."""
    return torch.cat(list(shard_rows.unbind(0)))


# --------------------------------------------------------------------------------------
# Hypothesis cases
# --------------------------------------------------------------------------------------


# The public strategies (fzero.testing.strategies): a parameter tree of 1-6 leaves (0-d and
# odd shapes, mixed dtypes), a world size 1-8 and an alignment 1, 2 or 16.
Case = LayoutCase
cases = layout_cases


# --------------------------------------------------------------------------------------
# 1. Shard sizes, padding, grouping, offsets
# --------------------------------------------------------------------------------------


@given(cases())
def test_shards_equal_padding_minimal_groups_and_offsets(case: Case):
    params = case.tree(case.tensors())
    lay = fzero.layout.build_layout(params, case.world, alignment=case.alignment)
    W, a = case.world, case.alignment

    assert lay.world_size == W and lay.alignment == a
    # Slots: every leaf, in tree order, with its path/shape/dtype/numel.
    assert [s.path for s in lay.slots] == case.paths
    assert [s.shape for s in lay.slots] == list(case.shapes)
    assert [s.dtype for s in lay.slots] == list(case.dtypes)
    assert [s.numel for s in lay.slots] == [math.prod(s) for s in case.shapes]

    expected = ref_groups(case.dtypes)
    assert [g.dtype for g in lay.groups] == [d for d, _ in expected]
    assert [g.index for g in lay.groups] == list(range(len(expected)))
    for g, (dtype, members) in zip(lay.groups, expected):
        numel = sum(math.prod(case.shapes[i]) for i in members)
        assert g.opt_group == 0
        assert list(g.slots) == members
        assert g.numel == numel
        assert g.master_dtype == MASTER[dtype]
        # Equal shards, aligned, minimal padding.
        assert g.padded_numel == W * g.shard_numel
        assert g.shard_numel % a == 0 and g.shard_numel > 0
        assert g.padded_numel >= g.numel
        assert g.padded_numel - g.numel < W * a
        assert g.padded_numel == ref_padded(numel, W, a)
        assert g.padding == g.padded_numel - numel
        # Offsets contiguous in tree order.
        offset = 0
        for i in members:
            assert lay.slots[i].group == g.index
            assert lay.slots[i].offset == offset
            offset += math.prod(case.shapes[i])
    assert lay.num_params == sum(math.prod(s) for s in case.shapes)
    assert lay.num_padded == sum(g.padded_numel for g in lay.groups)

    # Re-laying out for another world size equals laying out directly.
    other = (W % 8) + 1
    direct = fzero.layout.build_layout(params, other, alignment=a)
    moved = lay.with_world_size(other)
    assert moved.slots == direct.slots
    assert moved.groups == direct.groups
    assert moved.world_size == other
    assert moved == direct and moved.fingerprint == direct.fingerprint
    if other != W:
        assert moved != lay


# --------------------------------------------------------------------------------------
# 2. init_shard's master rows
# --------------------------------------------------------------------------------------


@given(cases())
def test_init_shard_master_equals_cat_pad_chunk(case: Case):
    tensors = case.tensors()
    comm = fzero.SimulatedWorld(case.world)
    shard = fzero.init_shard(case.tree(tensors), comm, alignment=case.alignment)
    expected = ref_groups(case.dtypes)
    assert len(shard.master) == len(expected)
    assert shard.frozen == ()
    for m, (dtype, members) in zip(shard.master, expected):
        numel = sum(tensors[i].numel() for i in members)
        padded = ref_padded(numel, case.world, case.alignment)
        ref = ref_flat([tensors[i] for i in members], MASTER[dtype], padded)
        pieces = torch.chunk(ref, case.world)
        assert m.dtype == MASTER[dtype]
        assert tuple(m.shape) == (case.world, padded // case.world)
        for r in range(case.world):
            assert_bitwise(m[r], pieces[r], f"rank {r}")
    # The original parameters are untouched (no aliasing with the master copy).
    for t, u in zip(tensors, case.tensors()):
        assert_bitwise(t, u)


# --------------------------------------------------------------------------------------
# 3. all-gather after scatter round-trips bitwise
# --------------------------------------------------------------------------------------


@given(cases())
def test_all_gather_after_init_round_trips_bitwise(case: Case):
    tensors = case.tensors()
    comm = fzero.SimulatedWorld(case.world)
    shard = fzero.init_shard(case.tree(tensors), comm, alignment=case.alignment)
    full = fzero.full_params(shard, comm)
    assert isinstance(full, dict) and set(full) == {"a", "b"}
    assert isinstance(full["a"], list) and isinstance(full["b"], tuple)
    leaves = case.leaves_of(full)
    assert len(leaves) == case.n
    for path, x, t in zip(case.paths, leaves, tensors):
        assert x.dtype == t.dtype, path
        assert tuple(x.shape) == (case.world, *t.shape), path
        for r in range(case.world):
            assert_bitwise(x[r], t, f"{path} rank {r}")

    # Flat buffers: every rank holds the whole padded buffer, padding zero.
    flats = fzero.all_gather_params(shard, comm)
    for f, (dtype, members) in zip(flats, ref_groups(case.dtypes)):
        numel = sum(tensors[i].numel() for i in members)
        ref = ref_flat([tensors[i] for i in members], dtype, ref_padded(numel, case.world, case.alignment))
        assert f.dtype == dtype
        for r in range(case.world):
            assert_bitwise(f[r], ref, f"flat rank {r}")

    # An explicit compute dtype casts every leaf (float64 holds every value exactly).
    full64 = fzero.full_params(shard, comm, dtype=F64)
    for path, x, t in zip(case.paths, case.leaves_of(full64), tensors):
        assert x.dtype == F64
        assert torch.equal(x, t.to(F64).expand(case.world, *t.shape)), path


# --------------------------------------------------------------------------------------
# 4. reduce_scatter_grads is the mean over ranks, sharded
# --------------------------------------------------------------------------------------

TOL = {F32: dict(rtol=1e-6, atol=2e-6), F64: dict(rtol=1e-12, atol=1e-12)}


@given(cases())
def test_reduce_scatter_grads_is_sharded_mean(case: Case):
    W = case.world
    comm = fzero.SimulatedWorld(W)
    tensors = case.tensors()
    shard = fzero.init_shard(case.tree(tensors), comm, alignment=case.alignment)
    grads = case.grads()
    means = [g.double().mean(0) for g in grads]  # float64 reference

    out = fzero.reduce_scatter_grads(shard, case.tree(grads), comm)
    out_ar = fzero.reduce_scatter_grads(shard, case.tree(grads), comm, via_all_reduce=True)
    groups = ref_groups(case.dtypes)
    assert len(out) == len(out_ar) == len(groups)
    for s, s_ar, (dtype, members) in zip(out, out_ar, groups):
        md = MASTER[dtype]
        numel = sum(tensors[i].numel() for i in members)
        padded = ref_padded(numel, W, case.alignment)
        ref = ref_flat([means[i] for i in members], F64, padded)
        pieces = torch.chunk(ref, W)
        assert s.dtype == md and s_ar.dtype == md
        assert tuple(s.shape) == tuple(s_ar.shape) == (W, padded // W)
        for r in range(W):
            torch.testing.assert_close(s[r].double(), pieces[r], **TOL[md])
            torch.testing.assert_close(s_ar[r].double(), pieces[r], **TOL[md])
        # Padding is exactly zero.
        assert torch.equal(full_buffer(s)[numel:], torch.zeros(padded - numel, dtype=md))

    # Round trip: gathering the reduced shards reproduces the mean gradients.
    as_params = dataclasses.replace(shard, master=out)
    back = fzero.full_params(as_params, comm, dtype=F64)
    for path, x, mean, d in zip(case.paths, case.leaves_of(back), means, case.dtypes):
        assert tuple(x.shape) == (W, *mean.shape), path
        for r in range(W):
            torch.testing.assert_close(x[r], mean, **TOL[MASTER[d]], msg=path)
    # ... and in the parameters' own dtypes (a cast of the master values).
    back_own = fzero.full_params(as_params, comm)
    for path, x, x64, d in zip(case.paths, case.leaves_of(back_own), case.leaves_of(back), case.dtypes):
        assert x.dtype == d, path
        assert_bitwise(x, x64.to(d), path)


@given(cases())
def test_padding_stays_zero_for_huge_gradients(case: Case):
    W = case.world
    comm = fzero.SimulatedWorld(W)
    tensors = case.tensors()
    shard = fzero.init_shard(case.tree(tensors), comm, alignment=case.alignment)
    grads = [g * (1e300 if g.dtype == F64 else 1e38) for g in case.grads()]
    groups = ref_groups(case.dtypes)
    for kwargs in ({}, {"via_all_reduce": True}, {"reduce_dtype": F16}, {"reduce_dtype": BF16}):
        out = fzero.reduce_scatter_grads(shard, case.tree(grads), comm, **kwargs)
        for s, (dtype, members) in zip(out, groups):
            numel = sum(tensors[i].numel() for i in members)
            pad = full_buffer(s)[numel:]
            assert s.dtype == MASTER[dtype]
            assert torch.equal(pad, torch.zeros_like(pad)), kwargs


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("reduce_dtype", [F16, BF16])
def test_low_precision_reduce_uses_divide_factors(world, reduce_dtype):
    # Factors as in FSDP: pre * post == W, pre a power of two near sqrt(W).
    known = {1: (1.0, 1.0), 2: (2.0, 1.0), 3: (2.0, 1.5), 4: (2.0, 2.0), 6: (4.0, 1.5), 8: (4.0, 2.0)}
    pre, post = fzero.comm.gradient_divide_factors(world)
    assert (pre, post) == known[world]
    comm = fzero.SimulatedWorld(world)
    params = {"w": torch.zeros(5, 3), "v": torch.zeros(7)}
    shard = fzero.init_shard(params, comm, alignment=2)
    # Values whose plain fp16 sum over 8 ranks would overflow (8 * 20000 > 65504).
    g = torch.Generator().manual_seed(world)
    gw = 20000.0 + torch.rand(world, 5, 3, generator=g, dtype=F64) * 100
    gv = torch.randn(world, 7, generator=g, dtype=F64)
    (out,) = fzero.reduce_scatter_grads(
        shard, {"w": gw.float(), "v": gv.float()}, comm, reduce_dtype=reduce_dtype
    )
    ref = torch.cat([gw.mean(0).reshape(-1), gv.mean(0)])
    got = full_buffer(out)
    assert out.dtype == F32
    assert torch.isfinite(got).all()
    rtol, atol = (2e-2, 5e-2) if reduce_dtype == BF16 else (4e-3, 1e-2)
    torch.testing.assert_close(got[:22].double(), ref, rtol=rtol, atol=atol)
    assert torch.equal(got[22:], torch.zeros_like(got[22:]))


def test_flatten_group_and_flatten_one_match_cat():
    W = 3
    params = {"x": torch.randn(2, 3), "y": torch.randn(4, dtype=F64), "z": torch.randn(5)}
    lay = fzero.layout.build_layout(params, W, alignment=4)
    leaves = [torch.randn(W, 2, 3), torch.randn(W, 4, dtype=F64), torch.randn(W, 5)]
    g32, g64 = lay.groups
    flat = flatten_group(lay, g32, leaves)
    ref = torch.cat([leaves[0].reshape(W, -1), leaves[2].reshape(W, -1), torch.zeros(W, 1)], dim=1)
    assert torch.equal(flat, ref)
    flat64 = flatten_group(lay, g64, leaves)
    assert torch.equal(flat64, torch.cat([leaves[1], torch.zeros(W, 8)], dim=1))
    one = flatten_one(lay, g32, [leaf[1] for leaf in leaves])
    assert torch.equal(one, ref[1])


# --------------------------------------------------------------------------------------
# 5. Padding never reaches the norm or the parameters
# --------------------------------------------------------------------------------------


@given(cases())
def test_global_norm_counts_real_elements_once(case: Case):
    W = case.world
    comm = fzero.SimulatedWorld(W)
    shard = fzero.init_shard(case.tree(case.tensors()), comm, alignment=case.alignment)
    grads = case.grads()
    out = fzero.reduce_scatter_grads(shard, case.tree(grads), comm)
    norm = fzero.sharding.global_norm(out, comm)
    ref = torch.linalg.vector_norm(torch.cat([g.double().mean(0).reshape(-1) for g in grads]))
    assert norm.dim() == 0 and norm.dtype == F32
    torch.testing.assert_close(norm.double(), ref, rtol=1e-6, atol=0.0)


def _tree_loss(p, batch):
    x, y = batch
    h = torch.tanh(x @ p["w1"] + p["b1"])
    out = h.double() @ p["layers"][0] + p["layers"][1]
    return ((out - y) ** 2).mean()


def _tree_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(3, 5, generator=g),
        "b1": torch.randn(5, generator=g),
        "layers": [torch.randn(5, 2, generator=g, dtype=F64), torch.randn(2, generator=g, dtype=F64)],
    }


def _tree_batch(world, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * world, 3, generator=g), torch.randn(2 * world, 2, generator=g, dtype=F64)


@pytest.mark.parametrize("stage,clip", [(2, None), (1, None), (2, 0.05)])
def test_padding_stays_zero_through_training(stage, clip):
    W = 4
    comm = fzero.SimulatedWorld(W)
    params = _tree_model()
    opt = fzero.adamw(lr=0.1, weight_decay=0.1)
    state = fzero.init_train_state(params, opt, comm, stage=stage)
    # Group 0 (fp32): 15 + 5 = 20 elements -> shards of 16, padded 64; ranks 2, 3 own only padding.
    # Group 1 (fp64): 10 + 2 = 12 elements -> shards of 16, padded 64.
    numels = [20, 12]
    assert [g.numel for g in state.layout.groups] == numels
    assert [g.padded_numel for g in state.layout.groups] == [64, 64]
    step = fzero.make_train_step(_tree_loss, comm, clip_norm=clip)
    for i in range(4):
        state, metrics = step(state, comm.split_batch(_tree_batch(W, seed=i)))
        assert torch.isfinite(metrics["loss"]) and metrics["found_inf"].item() == 0
        assert metrics["grad_norm"].item() > 0
        for n, m, moments in zip(numels, state.shard.master, state.opt.moments):
            for t in (m, *moments):
                pad = full_buffer(t)[n:]
                assert torch.equal(pad, torch.zeros_like(pad)), f"step {i}"
    # The gathered compute parameters carry zero padding too, and the real params moved.
    for n, p in zip(numels, state.params):
        assert torch.equal(p[:, n:], torch.zeros_like(p[:, n:]))
    full = fzero.full_params(state.shard, comm)
    assert not torch.equal(full["w1"][0], params["w1"])
    assert not torch.equal(full["layers"][0][0], params["layers"][0])


# --------------------------------------------------------------------------------------
# 6. Edge cases: ranks owning only padding, counts not divisible by W
# --------------------------------------------------------------------------------------


def test_two_elements_on_three_ranks():
    comm = fzero.SimulatedWorld(3)
    w = torch.tensor([1.5, -2.25])
    lay = fzero.layout.build_layout({"w": w}, 3, alignment=1)
    (g,) = lay.groups
    assert (g.numel, g.shard_numel, g.padded_numel, g.padding) == (2, 1, 3, 1)
    shard = fzero.init_shard({"w": w}, comm, alignment=1)
    assert torch.equal(shard.master[0], torch.tensor([[1.5], [-2.25], [0.0]]))
    full = fzero.full_params(shard, comm)
    assert torch.equal(full["w"], w.expand(3, 2))

    grads = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 9.0]])}
    out = fzero.reduce_scatter_grads(shard, grads, comm)[0]
    assert torch.equal(out, torch.tensor([[3.0], [5.0], [0.0]]))

    def loss_fn(p, batch):
        return ((p["w"] * batch).sum() - 1.0) ** 2

    state = fzero.init_train_state({"w": w}, fzero.adamw(lr=0.1, weight_decay=0.1), comm, alignment=1)
    step = fzero.make_train_step(loss_fn, comm)
    batch = comm.split_batch(torch.tensor([[1.0, 2.0], [0.5, -1.0], [2.0, 3.0]]))
    for _ in range(3):
        state, metrics = step(state, batch)
        assert metrics["found_inf"].item() == 0
        assert torch.equal(state.shard.master[0][2], torch.zeros(1))
        for mom in state.opt.moments[0]:
            assert torch.equal(mom[2], torch.zeros(1))
    assert not torch.equal(state.shard.master[0][:2, 0], w)
    # What the ranks own is what they gather.
    full = fzero.full_params(state.shard, comm)
    assert torch.equal(full["w"][0], state.shard.master[0][:2, 0])


@pytest.mark.parametrize("alignment,shard_numel", [(1, 2), (2, 2), (16, 16)])
def test_seven_elements_on_four_ranks(alignment, shard_numel):
    W = 4
    comm = fzero.SimulatedWorld(W)
    w = torch.arange(1, 8, dtype=F32)
    shard = fzero.init_shard({"w": w}, comm, alignment=alignment)
    (g,) = shard.layout.groups
    assert g.shard_numel == shard_numel and g.padded_numel == W * shard_numel
    ref = torch.chunk(torch.cat([w, torch.zeros(W * shard_numel - 7)]), W)
    for r in range(W):
        assert torch.equal(shard.master[0][r], ref[r])
    assert torch.equal(fzero.full_params(shard, comm)["w"], w.expand(W, 7))
    gr = torch.arange(28, dtype=F32).reshape(W, 7)
    out = fzero.reduce_scatter_grads(shard, {"w": gr}, comm)[0]
    mean = torch.cat([gr.double().mean(0), torch.zeros(W * shard_numel - 7, dtype=F64)])
    torch.testing.assert_close(full_buffer(out).double(), mean, rtol=1e-6, atol=0)


# --------------------------------------------------------------------------------------
# 7. Frozen parameters stay out of the flat buffers and the optimizer
# --------------------------------------------------------------------------------------


def _frozen_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model[0].requires_grad_(False)
    return model


def test_frozen_module_parameters():
    W = 2
    comm = fzero.SimulatedWorld(W)
    model = _frozen_module()
    original = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.adamw(lr=0.05, weight_decay=0.1)
    state = fzero.init_train_state(model, opt, comm)
    lay = state.layout
    groups = {s.path: s.group for s in lay.slots}
    assert groups == {"0.weight": -1, "0.bias": -1, "2.weight": 0, "2.bias": 0}
    assert [s.path for s in lay.frozen_slots] == ["0.weight", "0.bias"]
    assert len(state.shard.frozen) == 2
    assert torch.equal(state.shard.frozen[0], original["0.weight"])
    assert torch.equal(state.shard.frozen[1], original["0.bias"])
    trainable = 6 * 3 + 3
    assert lay.num_params == trainable
    assert sum(g.numel for g in lay.groups) == trainable
    assert len(state.opt.moments) == len(lay.groups) == 1
    for g, moments in zip(lay.groups, state.opt.moments):
        assert len(moments) == 2
        for m in moments:
            assert tuple(m.shape) == (W, g.shard_numel)
    assert sum(m.shape[1] for m in state.shard.master) * W == lay.num_padded
    # The trainable master holds exactly the trainable parameters.
    ref = torch.cat([original["2.weight"].reshape(-1), original["2.bias"]])
    assert torch.equal(full_buffer(state.shard.master[0])[:trainable], ref)

    loss_fn = fzero.module_loss(model, torch.nn.functional.mse_loss)
    step = fzero.make_train_step(loss_fn, comm)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        batch = (torch.randn(4, 4, generator=g), torch.randn(4, 3, generator=g))
        state, metrics = step(state, comm.split_batch(batch))
        assert metrics["found_inf"].item() == 0
    full = fzero.full_params(state.shard, comm)
    assert set(full) == set(original)
    for name in ("0.weight", "0.bias"):
        for r in range(W):
            assert torch.equal(full[name][r], original[name]), name
    assert not torch.equal(full["2.weight"][0], original["2.weight"])
    assert not torch.equal(full["2.bias"][0], original["2.bias"])
    # The module itself is not modified by fzero.
    for k, v in model.named_parameters():
        assert torch.equal(v, original[k])


def test_frozen_pytree_leaf_via_trainable():
    W = 3
    comm = fzero.SimulatedWorld(W)
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g), "c": torch.randn(2, generator=g)}
    trainable = lambda p: p != "b"  # noqa: E731
    lay = fzero.layout.build_layout(params, W, trainable=trainable)
    assert [(s.path, s.group) for s in lay.slots] == [("a", 0), ("b", -1), ("c", 0)]
    assert [lay.slots[i].path for i in lay.groups[0].slots] == ["a", "c"]
    assert lay.slots[2].offset == 6 and lay.num_params == 8

    shard = fzero.init_shard(params, comm, trainable=trainable)
    assert len(shard.frozen) == 1 and torch.equal(shard.frozen[0], params["b"])
    ref = torch.cat([params["a"].reshape(-1), params["c"]])
    assert torch.equal(full_buffer(shard.master[0])[:8], ref)

    # Frozen gradients may be absent or present (and are ignored).
    ga, gc = torch.randn(W, 3, 2, generator=g), torch.randn(W, 2, generator=g)
    without = fzero.reduce_scatter_grads(shard, {"a": ga, "c": gc}, comm)[0]
    with_b = fzero.reduce_scatter_grads(shard, {"a": ga, "b": torch.full((W, 2), 1e30), "c": gc}, comm)[0]
    assert torch.equal(without, with_b)
    mean = torch.cat([ga.double().mean(0).reshape(-1), gc.double().mean(0)])
    torch.testing.assert_close(full_buffer(without)[:8].double(), mean, rtol=1e-6, atol=1e-7)

    def loss_fn(p, batch):
        return ((batch @ p["a"] + p["b"] * p["c"]) ** 2).mean()

    state = fzero.init_train_state(params, fzero.adamw(lr=0.1, weight_decay=0.1), comm, trainable=trainable)
    assert sum(g.numel for g in state.layout.groups) == 8
    step = fzero.make_train_step(loss_fn, comm)
    for _ in range(2):
        state, _ = step(state, comm.split_batch(torch.randn(W * 2, 3, generator=g)))
    full = fzero.full_params(state.shard, comm)
    assert torch.equal(full["b"], params["b"].expand(W, 2))
    assert not torch.equal(full["a"][0], params["a"])
    assert not torch.equal(full["c"][0], params["c"])


# --------------------------------------------------------------------------------------
# 8. Parameter groups, fingerprints, first_difference, with_world_size
# --------------------------------------------------------------------------------------


class NamedNet(torch.nn.Module):
    def __init__(self, d_hidden: int = 5):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, d_hidden)
        self.norm = torch.nn.LayerNorm(d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, 3)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


def _sequential(d_hidden: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, d_hidden), torch.nn.LayerNorm(d_hidden), torch.nn.Linear(d_hidden, 3)
    )


NO_DECAY_OPT = dict(lr=0.1, weight_decay=0.1, groups=[(fzero.optim.no_weight_decay, {"weight_decay": 0.0})])


def _check_decay_groups(model, decay: list[str], no_decay: list[str], predicate=None):
    W = 2
    comm = fzero.SimulatedWorld(W)
    opt = fzero.adamw(**NO_DECAY_OPT) if predicate is None else fzero.adamw(
        **{**NO_DECAY_OPT, "groups": [(predicate, {"weight_decay": 0.0})]}
    )
    state = fzero.init_train_state(model, opt, comm)
    lay = state.layout
    names = [s.path for s in lay.slots]
    by_group = [(g.opt_group, [names[i] for i in g.slots]) for g in lay.groups]
    assert by_group == [(0, decay), (1, no_decay)]
    assert state.opt.hyper[0]["weight_decay"].item() == pytest.approx(0.1)
    assert state.opt.hyper[1]["weight_decay"].item() == 0.0

    # With zero gradients AdamW only decays: weights shrink by (1 - lr * wd), the rest stay.
    params = dict(model.named_parameters())
    zeros = tuple(torch.zeros_like(m) for m in state.shard.master)
    shard, _ = fzero.shard_step(state.shard, state.opt, zeros)
    full = fzero.full_params(shard, comm)
    for name in decay:
        torch.testing.assert_close(full[name][0], params[name].detach() * 0.99, rtol=1e-6, atol=0)
    for name in no_decay:
        assert torch.equal(full[name][0], params[name].detach()), name


def test_param_groups_named_norm_module():
    _check_decay_groups(
        NamedNet(),
        decay=["fc1.weight", "fc2.weight"],
        no_decay=["fc1.bias", "norm.weight", "norm.bias", "fc2.bias"],
    )


def test_param_groups_sequential_layernorm():
    # In nn.Sequential(Linear, LayerNorm, Linear) the LayerNorm weight is "1.weight": its name
    # cannot say it is a norm, so the module-aware predicate must be used.
    model = _sequential()
    _check_decay_groups(
        model,
        decay=["0.weight", "2.weight"],
        no_decay=["0.bias", "1.weight", "1.bias", "2.bias"],
        predicate=fzero.optim.no_weight_decay_for(model),
    )
    assert not fzero.optim.no_weight_decay("1.weight")  # the name-based predicate cannot know


def test_fingerprint_and_first_difference():
    base = fzero.layout.build_layout(_sequential(seed=0), 4)
    same = fzero.layout.build_layout(_sequential(seed=1), 4)  # other values, same layout
    assert base == same and hash(base) == hash(same)
    assert base.fingerprint == same.fingerprint
    assert base.first_difference(same) is None

    wider = fzero.layout.build_layout(_sequential(d_hidden=6), 4)
    assert wider.fingerprint != base.fingerprint and wider != base
    assert "0.weight" in base.first_difference(wider)
    assert "shape" in base.first_difference(wider)

    m64 = _sequential().double()
    as64 = fzero.layout.build_layout(m64, 4)
    assert as64.fingerprint != base.fingerprint
    assert "0.weight" in base.first_difference(as64) and "dtype" in base.first_difference(as64)

    m_half = _sequential()
    m_half[2].to(torch.bfloat16)
    mixed = fzero.layout.build_layout(m_half, 4)
    assert mixed.fingerprint != base.fingerprint
    assert "2.weight" in base.first_difference(mixed)

    other_world = fzero.layout.build_layout(_sequential(), 3)
    assert other_world.fingerprint != base.fingerprint
    assert "world_size" in base.first_difference(other_world)

    other_align = fzero.layout.build_layout(_sequential(), 4, alignment=8)
    assert other_align.fingerprint != base.fingerprint
    assert "alignment" in base.first_difference(other_align)

    frozen_model = _sequential()
    frozen_model[1].weight.requires_grad_(False)
    frozen = fzero.layout.build_layout(frozen_model, 4)
    assert frozen.fingerprint != base.fingerprint
    assert "1.weight" in base.first_difference(frozen)



def test_first_difference_names_added_or_renamed_parameter():
    la = fzero.layout.build_layout({"a": torch.zeros(2), "b": torch.zeros(3)}, 2)
    extra = fzero.layout.build_layout({"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(1)}, 2)
    renamed = fzero.layout.build_layout({"a": torch.zeros(2), "bb": torch.zeros(3)}, 2)
    assert la != extra and la != renamed
    assert "'c'" in la.first_difference(extra)
    assert "'bb'" in la.first_difference(renamed)
    # The same for modules: a parameter that exists in only one of them is named.
    with_extra = _sequential()
    with_extra.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))
    assert "scale" in fzero.layout.build_layout(_sequential(), 2).first_difference(fzero.layout.build_layout(with_extra, 2))


def test_fingerprint_sees_optimizer_groups():
    # The same flat-group indices but swapped optimizer groups: different hyperparameters
    # apply to each buffer, so the layouts must not compare equal.
    params = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    decay_w = fzero.layout.build_layout(params, 2, group_of=lambda p: 0 if p == "w" else 1)
    decay_b = fzero.layout.build_layout(params, 2, group_of=lambda p: 1 if p == "w" else 0)
    assert [g.opt_group for g in decay_w.groups] == [0, 1]
    assert [g.opt_group for g in decay_b.groups] == [1, 0]
    assert decay_w.groups != decay_b.groups
    assert decay_w.fingerprint != decay_b.fingerprint
    assert decay_w != decay_b
    assert decay_w.first_difference(decay_b) is not None


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_with_world_size_equals_direct_build_with_groups(world):
    model = NamedNet()
    model.fc2.to(F64)
    model.fc1.weight.requires_grad_(False)
    opt = fzero.adamw(**NO_DECAY_OPT)
    base = fzero.layout.build_layout(model, 4, group_of=opt.group_of, alignment=2)
    direct = fzero.layout.build_layout(model, world, group_of=opt.group_of, alignment=2)
    moved = base.with_world_size(world)
    assert moved.slots == direct.slots
    assert moved.groups == direct.groups
    assert (moved.world_size, moved.alignment) == (world, 2)
    assert moved.fingerprint == direct.fingerprint
    # (opt_group, dtype) groups in first-appearance order; frozen fc1.weight nowhere.
    assert [(g.opt_group, g.dtype) for g in direct.groups] == [(1, F32), (0, F64), (1, F64)]
    assert direct.slots[0].group == -1


def test_module_order_is_registration_order():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.zeta = torch.nn.Parameter(torch.arange(3.0))
            self.alpha = torch.nn.Parameter(torch.arange(10.0, 12.0))

    comm = fzero.SimulatedWorld(2)
    shard = fzero.init_shard(Net(), comm, alignment=1)
    assert [s.path for s in shard.layout.slots] == ["zeta", "alpha"]
    assert [s.offset for s in shard.layout.slots] == [0, 3]
    assert torch.equal(full_buffer(shard.master[0]), torch.tensor([0.0, 1.0, 2.0, 10.0, 11.0, 0.0]))


@pytest.mark.parametrize(
    "tree, first, second, path",
    [
        ({"a": {"b": torch.ones(2)}, "a.b": torch.ones(3)}, "['a']['b']", "['a.b']", "a.b"),
        ({0: torch.ones(2), "0": torch.ones(2)}, "[0]", "['0']", "0"),
    ],
)
def test_colliding_paths_are_refused_naming_both(tree, first, second, path):
    """Two leaves with one dotted path would share a checkpoint key (one of them lost)."""
    want = f"parameters {first} and {second} both have the path {path!r}"
    with pytest.raises(ValueError, match=re.escape(want)):
        fzero.init_train_state(tree, fzero.adamw(lr=1e-3), fzero.SimulatedWorld(2))
    with pytest.raises(ValueError, match="both have the path"):
        fzero.layout.build_layout(tree, 2)
