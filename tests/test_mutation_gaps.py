"""Deterministic cases for behaviour that mutation testing (``tools/mutate.py``) found unpinned."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as tp

import fzero
from fzero.pytree import replace


# --------------------------------------------------------------------------------------
# fzero/scaler.py: argument checks, at their boundaries (valid edge accepted, invalid raises)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(init_scale=0.0), "init_scale"),
        (dict(init_scale=-1.0), "init_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(growth_factor=0.5), "growth_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(growth_interval=2.0), "growth_interval"),
        (dict(min_scale=0.0), "min_scale"),
        (dict(init_scale=4.0, min_scale=8.0), "min_scale"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(hysteresis=2.0), "hysteresis"),
    ],
)
def test_init_scaler_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        fzero.init_scaler(**kwargs)


def test_init_scaler_accepts_edges():
    s = fzero.init_scaler(4.0, growth_factor=1.0 + 2.0**-20, backoff_factor=2.0**-20, growth_interval=1,
                          min_scale=4.0, hysteresis=1)
    assert s.scale.item() == 4.0 and s.scale.dtype == torch.float32
    assert s.growth_tracker.dtype == torch.int32 and int(s.growth_tracker) == 0
    assert s.hysteresis_left.dtype == torch.int32 and int(s.hysteresis_left) == 1
    assert s.dynamic and s.min_scale == 4.0 and s.hysteresis == 1 and s.growth_interval == 1
    assert int(fzero.init_scaler(hysteresis=3).hysteresis_left) == 3
    assert fzero.init_scaler(1.0, min_scale=2.0**-20).min_scale == 2.0**-20  # a floor below 1 is fine
    d = fzero.init_scaler()
    assert d.scale.item() == 2.0**16 and d.growth_factor == 2.0 and d.backoff_factor == 0.5
    assert d.growth_interval == 2000 and d.min_scale is None and d.hysteresis is None


@pytest.mark.parametrize("value", [0.0, -2.0])
def test_static_scaler_rejects_non_positive(value):
    with pytest.raises(ValueError, match="positive"):
        fzero.static_scaler(value)


def test_static_scaler_state():
    s = fzero.static_scaler(3.0)
    assert not s.dynamic and s.scale.item() == 3.0 and s.scale.dtype == torch.float32
    assert int(s.growth_tracker) == 0 and int(s.hysteresis_left) == 1
    assert fzero.static_scaler().scale.item() == 1.0
    # a static scaler is returned unchanged by update_scale, overflow or not
    for flag in (0.0, 1.0):
        assert fzero.update_scale(s, torch.tensor(flag)) is s


def test_min_scale_floor_is_a_floor_not_a_ceiling():
    s = fzero.init_scaler(64.0, backoff_factor=0.5, growth_interval=1, min_scale=8.0)
    s = fzero.update_scale(s, torch.tensor(1.0))  # backs off 64 -> 32, above the floor
    assert s.scale.item() == 32.0
    s = fzero.update_scale(s, torch.tensor(0.0))  # grows 32 -> 64
    assert s.scale.item() == 64.0


def test_hysteresis_refills_on_growth_only():
    s = fzero.init_scaler(16.0, growth_interval=2, hysteresis=3)
    s = fzero.update_scale(s, torch.tensor(1.0))
    assert s.scale.item() == 16.0 and int(s.hysteresis_left) == 2 and int(s.growth_tracker) == 0
    s = fzero.update_scale(s, torch.tensor(0.0))
    assert int(s.hysteresis_left) == 2 and int(s.growth_tracker) == 1
    s = fzero.update_scale(s, torch.tensor(0.0))  # grows: refilled
    assert s.scale.item() == 32.0 and int(s.hysteresis_left) == 3 and int(s.growth_tracker) == 0


# --------------------------------------------------------------------------------------
# fzero/optim.py: hyperparameter checks at their boundaries, groups, set_hyperparams
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: fzero.sgd(lr=0.0, momentum=0.0, dampening=-1.0, weight_decay=0.0),
        lambda: fzero.adam(lr=0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0),
        lambda: fzero.adamw(betas=(0.0, 0.0), eps=0.0, weight_decay=0.0),
        lambda: fzero.sgd(momentum=0.9, nesterov=True),
    ],
)
def test_boundary_hyperparameters_are_accepted(make):
    make()


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: fzero.adamw(betas=(0.9, -0.1)), "beta2"),
        (lambda: fzero.adamw(weight_decay=-1e-9), "weight_decay"),
        (lambda: fzero.sgd(lr=-1e-9), "lr"),
        (lambda: fzero.adam(groups=[(lambda p: True, {"eps": -1.0})]), "eps"),
    ],
)
def test_negative_hyperparameters_rejected(make, field):
    with pytest.raises(ValueError, match=rf"invalid {field}\b"):
        make()


def test_optimizer_static_flags_and_moments():
    assert fzero.sgd().moment_names == () and not fzero.sgd().momentum_buffer
    assert fzero.sgd(momentum=0.5).moment_names == ("momentum_buffer",)
    assert fzero.sgd(momentum=0.5, nesterov=True).nesterov
    assert fzero.adam().moment_names == ("exp_avg", "exp_avg_sq")
    assert fzero.adamw(amsgrad=True).moment_names == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert fzero.adam(maximize=True).maximize and fzero.adam(amsgrad=True).amsgrad
    assert fzero.adamw().kind == "adamw" and fzero.adam().kind == "adam" and fzero.sgd().kind == "sgd"
    assert dict(fzero.adamw().defaults) == dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
    assert dict(fzero.adam().defaults)["weight_decay"] == 0.0
    assert dict(fzero.sgd().defaults) == dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0)


def test_group_overrides_first_match_wins():
    opt = fzero.sgd(lr=0.1, groups=[(lambda p: p.startswith("a"), {"lr": 0.2, "momentum": 0.5}),
                                    (lambda p: True, {"lr": 0.3})])
    assert opt.group_of("ab") == 1 and opt.group_of("b") == 2
    assert opt.hyperparams(1) == dict(lr=0.2, momentum=0.5, dampening=0.0, weight_decay=0.0)
    assert opt.hyperparams(2)["lr"] == 0.3 and opt.hyperparams(0)["lr"] == 0.1
    g = opt.groups[0]
    assert g.overrides == (("lr", 0.2), ("momentum", 0.5)) and all(type(v) is float for _, v in g.overrides)


def test_init_opt_state_and_set_hyperparams():
    opt = fzero.adamw(lr=0.1, groups=[(lambda p: p == "x", {"lr": 0.2})])
    master = [torch.randn(2, 4), torch.randn(2, 3, dtype=torch.float64)]
    st = fzero.optim.init_opt_state(opt, master)
    assert st.step.dtype == torch.int64 and int(st.step) == 0
    assert [h["lr"].item() for h in st.hyper] == [0.1, 0.2]
    assert all(v.dtype == torch.float64 and v.shape == () for h in st.hyper for v in h.values())
    for m, mm in zip(master, st.moments):
        assert len(mm) == 2 and all(x.shape == m.shape and x.dtype == m.dtype and not x.any() for x in mm)
    one = fzero.optim.set_hyperparams(st, group=1, lr=0.5)
    assert one.hyper[1]["lr"].item() == 0.5 and one.hyper[0]["lr"].item() == 0.1
    assert st.hyper[1]["lr"].item() == 0.2  # the input state is unchanged
    both = fzero.optim.set_hyperparams(st, lr=torch.tensor(0.7, dtype=torch.float32), weight_decay=0.0)
    assert [h["lr"].item() for h in both.hyper] == pytest.approx([0.7, 0.7])
    assert all(h["lr"].dtype == torch.float64 and h["weight_decay"].item() == 0.0 for h in both.hyper)
    with pytest.raises(ValueError, match="no param group 2"):
        fzero.optim.set_hyperparams(st, group=2, lr=0.1)
    with pytest.raises(ValueError, match="no param group -1"):
        fzero.optim.set_hyperparams(st, group=-1, lr=0.1)
    with pytest.raises(ValueError, match="'momentum'"):
        fzero.optim.set_hyperparams(st, momentum=0.1)


def test_no_weight_decay_by_name():
    nwd = fzero.optim.no_weight_decay
    assert nwd("bias") and nwd("layer.bias") and nwd("ln_f.weight") and nwd("bn1.weight")
    assert nwd("block.norm.weight") and nwd("block.LayerNorm.weight")
    assert not nwd("weight") and not nwd("fc.weight") and not nwd("head.weight")
    assert not nwd("a.ln.b.weight")  # only the parent module's name counts


def test_no_weight_decay_for_module_types():
    m = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 1, bias=False),
                            torch.nn.BatchNorm1d(1), torch.nn.RMSNorm(1), torch.nn.GroupNorm(1, 1))
    pred = fzero.optim.no_weight_decay_for(m)
    assert pred("0.bias") and pred("1.weight") and pred("1.bias") and pred("3.weight") and pred("4.weight")
    assert pred("5.weight")
    assert not pred("0.weight") and not pred("2.weight")


# --------------------------------------------------------------------------------------
# fzero/sharding.py: the public pieces, directly (the steps use them; these pin each one)
# --------------------------------------------------------------------------------------
def _tree_params():
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(3, 2, generator=g),
        "b": torch.randn(5, generator=g, dtype=torch.float64),
        "f": torch.randn(2, generator=g),  # frozen
        "c": torch.randn(4, generator=g),
    }


TRAINABLE = {"a": True, "b": True, "f": False, "c": True}.__getitem__


@pytest.mark.parametrize("W", [1, 2, 3])
def test_gather_and_merge_round_trip(W):
    from fzero.layout import param_tree

    params = _tree_params()
    comm = fzero.SimulatedWorld(W)
    shard = fzero.init_shard(params, comm, trainable=TRAINABLE, alignment=2)
    assert len(shard.frozen) == 1 and torch.equal(shard.frozen[0], params["f"])
    flats = fzero.all_gather_params(shard, comm)
    assert [f.dtype for f in flats] == [g.dtype for g in shard.layout.groups]
    assert all(f.shape == (W, g.padded_numel) for f, g in zip(flats, shard.layout.groups))
    half = fzero.all_gather_params(shard, comm, torch.bfloat16)
    assert all(h.dtype == torch.bfloat16 and torch.equal(h, f.to(torch.bfloat16)) for h, f in zip(half, flats))
    frozen = dict(zip([s.path for s in shard.layout.frozen_slots], shard.frozen))  # {path: whole tensor}
    tree = param_tree(shard.layout, flats, frozen, torch.float64)
    assert list(tree) == ["a", "b", "f", "c"]
    for row in range(W):
        views = {k: v[row] for k, v in tree.items() if k != "f"}
        assert sorted(views) == ["a", "b", "c"]
        for k, v in views.items():
            assert torch.equal(v, params[k])
            assert v.untyped_storage().data_ptr() == flats[shard.layout.slots[shard.layout.paths.index(k)].group][
                row].untyped_storage().data_ptr()
        assert tree["f"][row].dtype == torch.float64 and torch.equal(tree["f"][row], params["f"].double())
    assert param_tree(shard.layout, flats, frozen)["f"].dtype == torch.float32
    full = fzero.full_params(shard, comm, dtype=torch.float64)
    for k, v in params.items():
        assert full[k].shape == (W, *v.shape) and full[k].dtype == torch.float64
        assert torch.equal(full[k], v.double().expand(W, *v.shape))


def test_stack_rows():
    from fzero.layout import stack_rows

    x = torch.arange(4.0)
    one = stack_rows([x])
    assert one.shape == (1, 4) and one.data_ptr() == x.data_ptr()  # a view on a real rank
    two = stack_rows([x, x + 1])
    assert two.shape == (2, 4) and torch.equal(two[1], x + 1)


def test_local_sq_norm_and_global_norm():
    from fzero.scaler import local_sq_norm

    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(3, 5, generator=g), torch.randn(3, 2, generator=g, dtype=torch.float64)]
    sq = local_sq_norm(shards)
    assert sq.shape == (3,) and sq.dtype == torch.float64
    expected = sum(s.double().square().sum(dim=1) for s in shards)
    torch.testing.assert_close(sq, expected, rtol=1e-6, atol=0)
    comm = fzero.SimulatedWorld(3)
    norm = fzero.sharding.global_norm(shards, comm)
    assert norm.shape == () and norm.dtype == torch.float32
    assert norm.item() == pytest.approx(expected.sum().sqrt().item(), rel=1e-6)
    # non-finite anywhere, or an fp32 shard norm beyond fp32's range, gives a non-finite norm
    bad = [shards[0].clone(), shards[1]]
    bad[0][2, 1] = float("nan")
    assert not torch.isfinite(local_sq_norm(bad)[2]) and torch.isfinite(local_sq_norm(bad)[:2]).all()
    huge = [torch.full((1, 2), 3e38)]
    assert torch.isinf(local_sq_norm(huge)).all()
    assert torch.isinf(fzero.sharding.global_norm(huge, fzero.SimulatedWorld(1)))


def test_check_world_errors():
    from fzero.sharding import check_world

    comm = fzero.SimulatedWorld(2)
    shard = fzero.init_shard({"w": torch.ones(6)}, comm, alignment=1)
    check_world(shard, comm)
    with pytest.raises(ValueError, match="world size is 3"):
        check_world(shard, fzero.SimulatedWorld(3))
    consumed = replace(shard, master=(torch.empty(0),))
    with pytest.raises(ValueError, match="donated"):
        check_world(consumed, comm)
    wrong = replace(shard, master=(torch.ones(2, 4),))
    with pytest.raises(ValueError, match=r"has shape \(2, 4\), expected \(2, 3\)"):
        check_world(wrong, comm)
    # the public functions check first
    with pytest.raises(ValueError, match="donated"):
        fzero.reduce_scatter_grads(consumed, {"w": torch.ones(2, 6)}, comm)
    with pytest.raises(ValueError, match="donated"):
        fzero.all_gather_params(consumed, comm)


def test_reduce_scatter_grads_dtypes_and_mean():
    comm = fzero.SimulatedWorld(2)
    shard = fzero.init_shard({"w": torch.zeros(5)}, comm, alignment=1)
    grads = {"w": torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [3.0, 2.0, 1.0, 0.0, -1.0]])}
    for via in (False, True):
        (out,) = fzero.reduce_scatter_grads(shard, grads, comm, via_all_reduce=via)
        assert out.dtype == torch.float32 and out.shape == (2, 3)
        assert out.tolist() == [[2.0, 2.0, 2.0], [2.0, 2.0, 0.0]]
        (lo,) = fzero.reduce_scatter_grads(shard, grads, comm, reduce_dtype=torch.bfloat16, via_all_reduce=via)
        assert lo.dtype == torch.float32 and lo.tolist() == [[2.0, 2.0, 2.0], [2.0, 2.0, 0.0]]
        # the reduction really runs in reduce_dtype: 1 + 2**-10 is 1.0 in bfloat16, not in float32
        fine = {"w": torch.full((2, 5), 1.0 + 2.0**-10)}
        (b16,) = fzero.reduce_scatter_grads(shard, fine, comm, reduce_dtype=torch.bfloat16, via_all_reduce=via)
        (f32,) = fzero.reduce_scatter_grads(shard, fine, comm, via_all_reduce=via)
        assert b16[0].tolist() == [1.0] * 3 and f32[0].tolist() == [1.0 + 2.0**-10] * 3
        (hi,) = fzero.reduce_scatter_grads(shard, grads, comm, reduce_dtype=torch.float64, via_all_reduce=via)
        assert hi.dtype == torch.float32 and hi.tolist() == [[2.0, 2.0, 2.0], [2.0, 2.0, 0.0]]


def test_shard_step_checks_and_step_count():
    comm = fzero.SimulatedWorld(2)
    opt = fzero.sgd(lr=0.5)
    shard = fzero.init_shard({"w": torch.ones(4)}, comm, optimizer=opt, alignment=1)
    st = fzero.optim.init_opt_state(opt, shard.master)
    g = (torch.ones(2, 2),)
    with pytest.raises(ValueError, match="got 2 gradient shards for 1 flat groups"):
        fzero.shard_step(shard, st, g + g)
    with pytest.raises(ValueError, match="another layout"):
        fzero.shard_step(shard, replace(st, moments=((), ())), g)
    with pytest.raises(ValueError, match=r"has shape \(2, 3\)"):
        fzero.shard_step(shard, st, (torch.ones(2, 3),))
    s1, o1 = fzero.shard_step(shard, st, (torch.ones(2, 2, dtype=torch.float64),))
    assert s1.master[0].dtype == torch.float32 and torch.equal(s1.master[0], torch.full((2, 2), 0.5))
    assert int(o1.step) == 1 and int(st.step) == 0 and torch.equal(shard.master[0], torch.ones(2, 2))
    s2, o2 = fzero.shard_step(s1, o1, g, torch.tensor(1.0))
    assert int(o2.step) == 1 and torch.equal(s2.master[0], s1.master[0])
    s3, o3 = fzero.shard_step(s2, o2, g, torch.tensor(0.0), donate=True)
    assert int(o3.step) == 2 and s3.master[0] is s2.master[0] and torch.equal(s3.master[0], torch.zeros(2, 2))


def test_unscale_and_check_empty_tree_raises():
    with pytest.raises(ValueError, match="no tensors"):
        fzero.unscale_and_check(fzero.init_scaler(2.0), {}, fzero.SimulatedWorld(2))


# --------------------------------------------------------------------------------------
# fzero/layout.py
# --------------------------------------------------------------------------------------
def test_describe_rows_and_fingerprint_format():
    from fzero.layout import build_layout

    lay = build_layout(_tree_params(), 2, trainable=TRAINABLE, alignment=2)
    head, *rows = lay.describe()
    assert head[:4] == ("world_size", 2, "alignment", 2)
    by_path = {r[0]: r for r in rows}
    assert by_path["f"][3:] == (False, -1, -1, 0, "")  # frozen: no flat group, no optimizer group, no parameter group
    assert by_path["a"][1:] == ((3, 2), "torch.float32", False, by_path["a"][4], 0, 0, "") and by_path["a"][4] >= 0
    assert by_path["b"][2] == "torch.float64"
    assert [s.path for s in lay.trainable_slots] == ["a", "b", "c"]
    assert [s.path for s in lay.frozen_slots] == ["f"]
    assert lay.num_params == 6 + 5 + 4
    assert lay.num_padded == sum(g.padded_numel for g in lay.groups) and lay.num_padded >= lay.num_params
    fp = lay.fingerprint
    assert len(fp) == 32 and int(fp, 16) >= 0
    assert lay == build_layout(_tree_params(), 2, trainable=TRAINABLE, alignment=2)
    assert hash(lay) == hash(fp)


def test_first_difference_tree_structure_only():
    from fzero.layout import build_layout

    x, y = torch.ones(2), torch.ones(3)
    as_list = build_layout([x, y], 1)
    as_dict = build_layout({"0": x, "1": y}, 1)
    assert as_list.paths == as_dict.paths
    assert as_list != as_dict
    assert as_list.first_difference(as_dict) == "the parameter tree structure differs (same paths, other container types)"
    assert as_list.first_difference(build_layout([x.clone(), y.clone()], 1)) is None


@pytest.mark.parametrize("reduce_dtype", [None, torch.bfloat16])
def test_reduce_scatter_grads_sends_what_it_says(reduce_dtype):
    """``via_all_reduce`` picks the collective (ZeRO-1's all-reduce + slice), in every reduce dtype."""
    inner = fzero.SimulatedWorld(2)
    counting = fzero.comm.CountingCommunicator(inner)
    shard = fzero.init_shard({"w": torch.zeros(5)}, inner, alignment=1)
    grads = {"w": torch.ones(2, 5)}
    for via, op in ((True, "all_reduce"), (False, "reduce_scatter")):
        counting.reset()
        (out,) = fzero.reduce_scatter_grads(shard, grads, counting, reduce_dtype=reduce_dtype, via_all_reduce=via)
        assert [r.op for r in counting.records] == [op]
        assert counting.records[0].dtype == (reduce_dtype or torch.float32)
        assert out.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def test_path_str_of_every_key_kind():
    from fzero.layout import path_str

    keys = (tp.MappingKey("a"), tp.SequenceKey(0), tp.GetAttrKey("w"), "other")
    assert path_str(keys) == "a.0.w.other"
