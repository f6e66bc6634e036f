"""Misuse is reported early, with the exception type the API documents and a
message that names the offending parameter path or field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fzero

W = 2


def _params():
    g = torch.Generator().manual_seed(0)
    return {
        "enc": {"weight": torch.randn(3, 4, generator=g), "bias": torch.randn(4, generator=g)},
        "head": [torch.randn(4, 2, generator=g)],
    }


def _grads(world=W):
    g = torch.Generator().manual_seed(1)
    return {
        "enc": {"weight": torch.randn(world, 3, 4, generator=g), "bias": torch.randn(world, 4, generator=g)},
        "head": [torch.randn(world, 4, 2, generator=g)],
    }


def _loss(p, batch):
    x, y = batch
    return ((torch.tanh(x @ p["enc"]["weight"] + p["enc"]["bias"]) @ p["head"][0] - y) ** 2).mean()


def _batch(world=W):
    g = torch.Generator().manual_seed(2)
    return torch.randn(2 * world, 3, generator=g), torch.randn(2 * world, 2, generator=g)


@pytest.fixture
def comm():
    return fzero.SimulatedWorld(W)


@pytest.fixture
def shard(comm):
    return fzero.init_shard(_params(), comm)


# --------------------------------------------------------------------------------------
# Gradient trees that do not match the layout
# --------------------------------------------------------------------------------------


def test_grads_missing_trainable_param(shard, comm):
    grads = _grads()
    del grads["enc"]["bias"]
    with pytest.raises(ValueError, match=r"missing.*'enc\.bias'"):
        fzero.reduce_scatter_grads(shard, grads, comm)


def test_grads_missing_list_entry(shard, comm):
    grads = _grads()
    grads["head"] = []
    with pytest.raises(ValueError, match=r"'head\.0'"):
        fzero.reduce_scatter_grads(shard, grads, comm)


def test_grads_extra_unknown_key(shard, comm):
    grads = _grads()
    grads["enc"]["gamma"] = torch.zeros(W, 4)
    with pytest.raises(ValueError, match=r"'enc\.gamma'.*not a parameter"):
        fzero.reduce_scatter_grads(shard, grads, comm)


def test_grads_wrong_shape(shard, comm):
    grads = _grads()
    grads["enc"]["weight"] = torch.zeros(W, 4, 3)
    with pytest.raises(ValueError, match=r"'enc\.weight'.*\(2, 4, 3\)"):
        fzero.reduce_scatter_grads(shard, grads, comm)


def test_grads_missing_rank_axis(shard, comm):
    grads = _grads()
    grads["head"][0] = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"'head\.0'.*local-rank axis"):
        fzero.reduce_scatter_grads(shard, grads, comm)


def test_grads_wrong_rank_axis_size(shard, comm):
    grads = _grads(world=3)
    with pytest.raises(ValueError, match=r"'enc\.weight'"):
        fzero.reduce_scatter_grads(shard, grads, comm)


def test_grads_non_floating(shard, comm):
    grads = _grads()
    grads["enc"]["bias"] = torch.zeros(W, 4, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"'enc\.bias'"):
        fzero.reduce_scatter_grads(shard, grads, comm)


def test_grads_non_tensor(shard, comm):
    grads = _grads()
    grads["enc"]["bias"] = "oops"
    with pytest.raises(TypeError, match=r"'enc\.bias'"):
        fzero.reduce_scatter_grads(shard, grads, comm)


# --------------------------------------------------------------------------------------
# A state built for another world
# --------------------------------------------------------------------------------------


def test_step_with_other_world_size():
    state = fzero.init_train_state(_params(), fzero.adamw(), fzero.SimulatedWorld(2))
    comm4 = fzero.SimulatedWorld(4)
    step = fzero.make_train_step(_loss, comm4)
    with pytest.raises(ValueError, match=r"world.size"):
        step(state, comm4.split_batch(_batch(world=4)))


def test_reduce_scatter_and_gather_with_other_world_size(shard):
    comm4 = fzero.SimulatedWorld(4)
    with pytest.raises(ValueError, match=r"world.size"):
        fzero.reduce_scatter_grads(shard, _grads(world=4), comm4)
    with pytest.raises(ValueError, match=r"world.size"):
        fzero.full_params(shard, comm4)
    with pytest.raises(ValueError, match=r"world.size"):
        fzero.all_gather_params(shard, comm4)


def test_master_shard_of_wrong_shape(shard, comm):
    bad = dataclasses.replace(shard, master=(shard.master[0][:, :-1],))
    with pytest.raises(ValueError, match=r"master\[0\]"):
        fzero.full_params(bad, comm)


def test_shard_step_with_wrong_number_of_grad_shards(comm):
    state = fzero.init_train_state(_params(), fzero.sgd(), comm)
    with pytest.raises(ValueError, match=r"flat group"):
        fzero.shard_step(state.shard, state.opt, ())


# --------------------------------------------------------------------------------------
# Parameters fzero cannot lay out
# --------------------------------------------------------------------------------------


def test_integer_param_named():
    params = {"w": torch.zeros(3), "ids": {"table": torch.arange(4)}}
    with pytest.raises(TypeError, match=r"'ids\.table'.*floating"):
        fzero.layout.build_layout(params, W)
    with pytest.raises(TypeError, match=r"'ids\.table'"):
        fzero.init_shard(params, fzero.SimulatedWorld(W))


def test_sparse_param_named():
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,), check_invariants=True)
    params = {"w": torch.zeros(3), "emb": [sparse]}
    with pytest.raises(TypeError, match=r"'emb\.0'.*sparse"):
        fzero.layout.build_layout(params, W)
    with pytest.raises(TypeError, match=r"'emb\.0'"):
        fzero.init_train_state(params, fzero.sgd(), fzero.SimulatedWorld(W))


def test_non_tensor_param_named():
    with pytest.raises(TypeError, match=r"'lr'"):
        fzero.layout.build_layout({"w": torch.zeros(3), "lr": 0.1}, W)


def test_module_all_frozen():
    model = torch.nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match=r"no trainable parameters"):
        fzero.layout.build_layout(model, W)
    with pytest.raises(ValueError, match=r"no trainable parameters"):
        fzero.init_train_state(model, fzero.adamw(), fzero.SimulatedWorld(W))


def test_pytree_all_excluded_by_trainable():
    with pytest.raises(ValueError, match=r"no trainable parameters"):
        fzero.layout.build_layout({"w": torch.zeros(3)}, W, trainable=lambda p: False)


@pytest.mark.parametrize("empty", [{}, [], ()])
def test_empty_tree(empty):
    with pytest.raises(ValueError, match=r"no trainable parameters.*empty"):
        fzero.layout.build_layout(empty, W)
    with pytest.raises(ValueError, match=r"no trainable parameters"):
        fzero.init_shard(empty, fzero.SimulatedWorld(W))


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_build_layout_bad_world_size(bad):
    with pytest.raises(ValueError, match=r"world_size"):
        fzero.layout.build_layout({"w": torch.zeros(3)}, bad)


@pytest.mark.parametrize("bad", [0, -4, 1.5])
def test_build_layout_bad_alignment(bad):
    with pytest.raises(ValueError, match=r"alignment"):
        fzero.layout.build_layout({"w": torch.zeros(3)}, W, alignment=bad)


# --------------------------------------------------------------------------------------
# Optimizer and step configuration
# --------------------------------------------------------------------------------------


def test_unknown_hyperparameter_in_group():
    with pytest.raises(ValueError, match=r"unknown hyperparameter 'momentum'"):
        fzero.adamw(groups=[(fzero.optim.no_weight_decay, {"momentum": 0.9})])
    with pytest.raises(ValueError, match=r"unknown hyperparameter 'beta1'"):
        fzero.sgd(groups=[(fzero.optim.no_weight_decay, {"beta1": 0.9})])


def test_invalid_value_in_group_named():
    with pytest.raises(ValueError, match=r"param group 2.*lr"):
        fzero.sgd(groups=[(lambda p: False, {"lr": 0.1}), (lambda p: True, {"lr": -1.0})])


@pytest.mark.parametrize("kwargs", [dict(nesterov=True), dict(nesterov=True, momentum=0.9, dampening=0.1)])
def test_nesterov_requires_momentum_without_dampening(kwargs):
    with pytest.raises(ValueError, match=r"nesterov"):
        fzero.sgd(**kwargs)


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: fzero.adam(betas=(1.0, 0.999)), "beta1"),
        (lambda: fzero.adamw(betas=(0.9, 1.0)), "beta2"),
        (lambda: fzero.adam(betas=(-0.1, 0.999)), "beta1"),
        (lambda: fzero.adamw(lr=-1e-3), "lr"),
        (lambda: fzero.adam(eps=-1.0), "eps"),
        (lambda: fzero.sgd(momentum=-0.5), "momentum"),
        (lambda: fzero.sgd(weight_decay=-0.1), "weight_decay"),
    ],
)
def test_invalid_hyperparameter_values(make, field):
    with pytest.raises(ValueError, match=rf"invalid {field}\b"):
        make()


def test_set_hyperparams_unknown_name_and_group(comm):
    state = fzero.init_train_state(_params(), fzero.adamw(), comm)
    with pytest.raises(ValueError, match=r"'foo'"):
        fzero.optim.set_hyperparams(state.opt, foo=1)
    with pytest.raises(ValueError, match=r"'momentum'"):
        fzero.optim.set_hyperparams(state.opt, group=0, momentum=0.9)
    with pytest.raises(ValueError, match=r"param group 3"):
        fzero.optim.set_hyperparams(state.opt, group=3, lr=0.1)
    # A valid call still works (the errors are not spurious).
    new = fzero.optim.set_hyperparams(state.opt, lr=0.5)
    assert new.hyper[0]["lr"].item() == 0.5


@pytest.mark.parametrize("stage", [0, 4, 5])
def test_make_train_step_bad_stage(stage, comm):
    with pytest.raises(ValueError, match=rf"stage.*{stage}"):
        fzero.make_train_step(_loss, comm, stage=stage)


def test_make_train_step_stage3_needs_the_module(comm):
    with pytest.raises(TypeError, match="needs the module: give fzero.module_loss"):
        fzero.make_train_step(_loss, comm, stage=3)


@pytest.mark.parametrize("kw,match", [
    ({"accum_steps": 0}, "accum_steps"),
    ({"accum_steps": 2.5}, "accum_steps"),
])
def test_make_train_step_bad_accumulation(kw, match, comm):
    with pytest.raises(ValueError, match=match):
        fzero.make_train_step(_loss, comm, **kw)


@pytest.mark.parametrize("clip", [0.0, -1.0])
def test_make_train_step_bad_clip_norm(clip, comm):
    with pytest.raises(ValueError, match=r"clip_norm"):
        fzero.make_train_step(_loss, comm, clip_norm=clip)


@pytest.mark.parametrize(
    "bad_loss",
    [
        lambda p, b: (p["enc"]["weight"] ** 2).sum(0),  # a vector
        lambda p, b: (p["enc"]["weight"] ** 2).sum().reshape(1),  # shape [1], not 0-d
        lambda p, b: 1.0,  # not a tensor
    ],
)
def test_loss_fn_must_return_scalar(bad_loss, comm):
    state = fzero.init_train_state(_params(), fzero.adamw(), comm)
    step = fzero.make_train_step(bad_loss, comm)
    with pytest.raises(ValueError, match=r"loss_fn must return a 0-d floating-point tensor"):
        step(state, comm.split_batch(_batch()))


def test_mixed_precision_rejects_non_floating_dtype():
    with pytest.raises(TypeError, match=r"param_dtype"):
        fzero.MixedPrecision(param_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"reduce_dtype"):
        fzero.MixedPrecision(reduce_dtype=torch.int8)


# --------------------------------------------------------------------------------------
# Communicators
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -2, 2.0, "2"])
def test_simulated_world_rejects_bad_size(bad):
    with pytest.raises(ValueError, match=r"world_size"):
        fzero.SimulatedWorld(bad)


def test_gradient_divide_factors_rejects_zero():
    with pytest.raises(ValueError, match=r"world_size"):
        fzero.comm.gradient_divide_factors(0)


def test_split_batch_names_indivisible_leaf():
    comm = fzero.SimulatedWorld(3)
    batch = {"x": torch.zeros(6, 2), "y": torch.zeros(5)}
    with pytest.raises(ValueError, match=r"\['y'\].*\(5,\).*world size 3"):
        comm.split_batch(batch)
    with pytest.raises(ValueError, match=r"\[1\]"):
        comm.split_batch((torch.zeros(6), torch.zeros(4, 2)))
    with pytest.raises(ValueError, match=r"\['s'\]"):
        comm.split_batch({"s": torch.tensor(1.0)})
    # A divisible batch splits into [W, B/W, ...] in rank order.
    out = comm.split_batch({"x": torch.arange(6.0)})
    assert torch.equal(out["x"], torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]))


def test_collectives_check_rank_axis():
    comm = fzero.SimulatedWorld(3)
    with pytest.raises(ValueError, match=r"reduce_scatter.*local-rank axis"):
        comm.reduce_scatter(torch.zeros(2, 6))
    with pytest.raises(ValueError, match=r"reduce_scatter.*W=3"):
        comm.reduce_scatter(torch.zeros(3, 7))
    with pytest.raises(ValueError, match=r"all_gather"):
        comm.all_gather(torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"all_reduce"):
        comm.all_reduce(torch.zeros(()))
    # ZeRO-1's reduction refuses a row it cannot cut into W chunks before it communicates
    with pytest.raises(ValueError, match=r"all_reduce_shard.*W=3"):
        comm.all_reduce_shard_start(torch.zeros(3, 7), "avg")
    x = torch.arange(18.0).reshape(3, 6)  # rank r keeps elements 2r, 2r+1 of the sum over ranks
    assert torch.equal(comm.all_reduce_shard_start(x, "sum")(), x.sum(0).view(3, 2))
    assert torch.equal(comm.all_reduce_shard_start(x, "avg")(), x.sum(0).view(3, 2) / 3)


def test_stage3_names_a_parameter_it_cannot_take_because_of_a_weak_reference():
    """torch.compile keeps weak references to the parameters of a module a compiled function
    ran; stage 3 cannot swap such a parameter for its meta stand-in, and says which and why."""
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    held = weakref.ref(model[1].weight)  # what a compiled step's guards would hold
    with pytest.raises(RuntimeError, match=r"'1\.weight'.*weak reference.*torch\._dynamo\.reset"):
        fzero.init_train_state(model, fzero.sgd(lr=0.1), fzero.SimulatedWorld(2), stage=3,
                               units=lambda name, m: name in ("0", "1"))
    assert held() is not None
    assert not any(p.is_meta for p in model.parameters())  # refused before any was taken
