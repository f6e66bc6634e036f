"""fzero's states are pytrees (optree in the fzero namespace, and torch.utils._pytree).

A flatten/unflatten round trip must keep every static field (jmp's
``DynamicLossScale`` loses ``min_loss_scale`` this way; fzero must not) and
give back exactly the same tensors; the leaves are exactly the state's tensors.
"""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
import torch.utils._pytree as tp

import fzero

SCALER_TENSORS = ("scale", "growth_tracker", "hysteresis_left")
SCALER_STATIC = ("growth_factor", "backoff_factor", "growth_interval", "min_scale", "hysteresis", "dynamic")


def _custom_scaler():
    s = fzero.init_scaler(
        1024.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7, min_scale=2.0, hysteresis=3
    )
    # move the tensors away from their initial values
    for inf in (True, False, False):
        s = fzero.update_scale(s, torch.tensor(float(inf)))
    assert int(s.growth_tracker) == 2 and int(s.hysteresis_left) == 2
    return s


SCALERS = {
    "custom": _custom_scaler,
    "default": lambda: fzero.init_scaler(),
    "floor_only": lambda: fzero.init_scaler(8.0, min_scale=0.5),
    "static": lambda: fzero.static_scaler(4.0),
}


def assert_same_scaler(a, b, *, same_objects=True):
    assert type(a) is type(b) is fzero.ScalerState
    for name in SCALER_STATIC:
        va, vb = getattr(a, name), getattr(b, name)
        assert type(va) is type(vb) and va == vb, name
    for name in SCALER_TENSORS:
        ta, tb = getattr(a, name), getattr(b, name)
        if same_objects:
            assert ta is tb, name
        assert ta.dtype == tb.dtype and ta.shape == tb.shape and torch.equal(ta, tb), name


def _flatten_optree(tree):
    return optree.tree_flatten(tree, namespace=fzero.pytree.NAMESPACE)


def _roundtrip_optree(tree):
    leaves, spec = _flatten_optree(tree)
    return leaves, optree.tree_unflatten(spec, leaves)


def _roundtrip_torch(tree):
    leaves, spec = tp.tree_flatten(tree)
    return leaves, tp.tree_unflatten(leaves, spec)


ROUNDTRIPS = {"optree": _roundtrip_optree, "torch": _roundtrip_torch}


def test_namespace():
    assert fzero.pytree.NAMESPACE == "fzero"


# ======================================================================================
# ScalerState
# ======================================================================================
@pytest.mark.parametrize("which", list(SCALERS))
@pytest.mark.parametrize("lib", list(ROUNDTRIPS))
def test_scaler_roundtrip(which, lib):
    s = SCALERS[which]()
    leaves, back = ROUNDTRIPS[lib](s)
    # the leaves are exactly the three tensors, in declaration order
    assert len(leaves) == 3
    assert all(x is getattr(s, n) for x, n in zip(leaves, SCALER_TENSORS))
    assert_same_scaler(back, s)


def test_scaler_roundtrip_keeps_min_scale_and_hysteresis():
    """The static config survives unflattening with *new* leaves (what jit/vmap do)."""
    s = _custom_scaler()
    for flatten, unflatten in (
        (_flatten_optree, lambda spec, ls: optree.tree_unflatten(spec, ls)),
        (tp.tree_flatten, lambda spec, ls: tp.tree_unflatten(ls, spec)),
    ):
        leaves, spec = flatten(s)
        new = [x.clone() + 0 for x in leaves]
        back = unflatten(spec, new)
        assert back.min_scale == 2.0 and back.hysteresis == 3
        assert back.growth_factor == 3.0 and back.backoff_factor == 0.25
        assert back.growth_interval == 7 and back.dynamic is True
        assert all(getattr(back, n) is x for n, x in zip(SCALER_TENSORS, new))
        # the rebuilt state behaves like the original under the update rule
        f = torch.tensor(1.0)
        assert_same_scaler(fzero.update_scale(back, f), fzero.update_scale(s, f), same_objects=False)


def test_scaler_static_config_is_in_the_treespec():
    a = fzero.init_scaler(8.0, min_scale=1.0)
    b = fzero.init_scaler(8.0, min_scale=2.0)
    c = fzero.init_scaler(8.0, min_scale=1.0)
    assert _flatten_optree(a)[1] != _flatten_optree(b)[1]
    assert _flatten_optree(a)[1] == _flatten_optree(c)[1]
    assert tp.tree_flatten(a)[1] != tp.tree_flatten(b)[1]
    assert tp.tree_flatten(a)[1] == tp.tree_flatten(c)[1]


def test_scaler_torch_paths_name_fields():
    s = _custom_scaler()
    pairs, _ = tp.tree_flatten_with_path(s)
    assert [tp.keystr(p) for p, _ in pairs] == [".scale", ".growth_tracker", ".hysteresis_left"]
    assert all(x is getattr(s, n) for (_, x), n in zip(pairs, SCALER_TENSORS))


@pytest.mark.parametrize("which", ["custom", "static"])
def test_scaler_torch_treespec_serialization_roundtrip(which):
    """torch.export stores the input TreeSpec with treespec_dumps; the loaded spec
    must equal the original, or ``torch.export.load(...).module()(scaler, ...)``
    rejects a ScalerState with "Trying to flatten user inputs with exported input
    tree spec". (fzero registers a serialized_type_name, so it means to support this.)
    """
    s = SCALERS[which]()
    leaves, spec = tp.tree_flatten(s)
    loaded = tp.treespec_loads(tp.treespec_dumps(spec))
    back = tp.tree_unflatten(leaves, loaded)
    assert_same_scaler(back, s)
    assert loaded == spec


def test_scaler_is_a_leaf_outside_the_namespace():
    s = _custom_scaler()
    leaves = optree.tree_leaves(s)  # no namespace: not a registered node
    assert len(leaves) == 1 and leaves[0] is s


@pytest.mark.parametrize("which", list(SCALERS))
def test_tree_map_identity_keeps_all_fields(which):
    s = SCALERS[which]()
    out = fzero.pytree.tree_map(lambda x: x, s)
    assert_same_scaler(out, s)
    # and maps over exactly the tensors
    seen = []
    doubled = fzero.pytree.tree_map(lambda x: seen.append(x) or x * 2, s)
    assert len(seen) == 3 and all(x is getattr(s, n) for x, n in zip(seen, SCALER_TENSORS))
    for n in SCALER_STATIC:
        assert getattr(doubled, n) == getattr(s, n)
    assert doubled.scale.item() == 2 * s.scale.item()
    # torch's tree_map agrees
    tdoubled = tp.tree_map(lambda x: x * 2, s)
    assert_same_scaler(tdoubled, doubled, same_objects=False)


def test_tree_map_multiple_trees():
    a, b = _custom_scaler(), _custom_scaler()
    out = fzero.pytree.tree_map(lambda x, y: x + y, a, b)
    assert out.scale.item() == 2 * a.scale.item()
    assert out.min_scale == 2.0 and out.hysteresis == 3


@pytest.mark.parametrize("which", list(SCALERS))
def test_scaler_is_frozen(which):
    s = SCALERS[which]()
    assert dataclasses.is_dataclass(s)
    for name in SCALER_TENSORS + SCALER_STATIC:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(s, name, getattr(s, name))


# ======================================================================================
# TrainState
# ======================================================================================
def _train_state(variant):
    torch.manual_seed(0)
    if variant == "linear":
        model = torch.nn.Linear(3, 2)
        comm = fzero.SimulatedWorld(2)
        return fzero.init_train_state(model, fzero.adamw(lr=1e-3), comm)
    # frozen parameter, fp16 compute, custom dynamic scaler, 3 ranks
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    comm = fzero.SimulatedWorld(3)
    return fzero.init_train_state(
        model,
        fzero.adamw(lr=1e-3),
        comm,
        precision=fzero.MixedPrecision(param_dtype=torch.float16),
        scaler=_custom_scaler(),
        trainable=lambda path: not path.startswith("0."),
    )


def _expected_leaves(st):
    """Every tensor of a TrainState, gathered by hand from its fields."""
    out = list(st.shard.master) + list(st.shard.frozen) + [st.opt.step]
    out += [v for d in st.opt.hyper for v in d.values()]
    out += [m for ms in st.opt.moments for m in ms]
    out += list(st.opt.missed)
    out += [getattr(st.scaler, n) for n in SCALER_TENSORS]
    out += list(st.params) + list(st.buffers) + list(st.rng) + list(st.calls)
    return out


def _assert_same_train_state(back, st):
    assert type(back) is fzero.TrainState
    assert type(back.shard) is fzero.ShardState and type(back.opt) is fzero.OptState
    assert back.shard.layout == st.shard.layout
    assert back.opt.optimizer == st.opt.optimizer
    assert back.precision == st.precision
    assert back.module == st.module
    assert all(a is b for a, b in zip(back.buffers, st.buffers)) and len(back.buffers) == len(st.buffers)
    assert all(a is b for a, b in zip(back.rng, st.rng)) and len(back.rng) == len(st.rng)
    assert back.layout == st.layout
    assert_same_scaler(back.scaler, st.scaler)
    # containers keep their types and every tensor is the very same object
    assert type(back.shard.master) is tuple and len(back.shard.master) == len(st.shard.master)
    assert all(a is b for a, b in zip(back.shard.master, st.shard.master))
    assert type(back.shard.frozen) is tuple and len(back.shard.frozen) == len(st.shard.frozen)
    assert all(a is b for a, b in zip(back.shard.frozen, st.shard.frozen))
    assert back.opt.step is st.opt.step
    assert len(back.opt.missed) == len(st.opt.missed) == 1 and back.opt.missed[0] is st.opt.missed[0]
    assert type(back.opt.hyper) is tuple and len(back.opt.hyper) == len(st.opt.hyper)
    for hb, hs in zip(back.opt.hyper, st.opt.hyper):
        assert type(hb) is dict and set(hb) == set(hs)
        assert all(hb[k] is hs[k] for k in hs)
    assert len(back.opt.moments) == len(st.opt.moments)
    for mb, ms in zip(back.opt.moments, st.opt.moments):
        assert type(mb) is tuple and len(mb) == len(ms) and all(a is b for a, b in zip(mb, ms))
    assert type(back.params) is tuple and all(a is b for a, b in zip(back.params, st.params))
    assert type(back.calls) is tuple and len(back.calls) == len(st.calls) == 1 and back.calls[0] is st.calls[0]
    assert back.stage == st.stage


@pytest.mark.parametrize("variant", ["linear", "frozen_fp16"])
@pytest.mark.parametrize("lib", list(ROUNDTRIPS))
def test_train_state_roundtrip(variant, lib):
    st = _train_state(variant)
    leaves, back = ROUNDTRIPS[lib](st)
    expected = _expected_leaves(st)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    assert len(leaves) == len(expected)
    assert sorted(map(id, leaves)) == sorted(map(id, expected))
    _assert_same_train_state(back, st)
    if variant == "frozen_fp16":
        assert len(st.shard.frozen) == 2  # the test really covers frozen leaves
        assert st.precision.param_dtype == torch.float16
        assert back.scaler.min_scale == 2.0 and back.scaler.hysteresis == 3


@pytest.mark.parametrize("variant", ["linear", "frozen_fp16"])
def test_train_state_roundtrip_with_new_leaves(variant):
    """Unflattening cloned leaves gives an equal state built from those clones."""
    st = _train_state(variant)
    for flatten, unflatten in (
        (_flatten_optree, lambda spec, ls: optree.tree_unflatten(spec, ls)),
        (tp.tree_flatten, lambda spec, ls: tp.tree_unflatten(ls, spec)),
    ):
        leaves, spec = flatten(st)
        clones = [x.clone() for x in leaves]
        back = unflatten(spec, clones)
        back_leaves, back_spec = flatten(back)
        assert back_spec == spec
        assert len(back_leaves) == len(clones) and all(a is b for a, b in zip(back_leaves, clones))
        assert back.shard.layout == st.shard.layout and back.opt.optimizer == st.opt.optimizer
        for a, b in zip(back_leaves, leaves):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("variant", ["linear", "frozen_fp16"])
def test_train_state_tree_map(variant):
    st = _train_state(variant)
    back = fzero.pytree.tree_map(lambda x: x, st)
    _assert_same_train_state(back, st)
    zeros = fzero.pytree.tree_map(torch.zeros_like, st)
    assert zeros.shard.layout == st.shard.layout and zeros.precision == st.precision
    assert all(not x.any() for x in _expected_leaves(zeros))
    assert len(_expected_leaves(zeros)) == len(_expected_leaves(st))


@pytest.mark.parametrize("variant", ["linear", "frozen_fp16"])
def test_states_are_frozen(variant):
    st = _train_state(variant)
    for obj, names in (
        (st, ("shard", "opt", "scaler", "params", "precision")),
        (st.shard, ("master", "frozen", "layout")),
        (st.opt, ("step", "hyper", "moments", "optimizer")),
        (st.scaler, SCALER_TENSORS + SCALER_STATIC),
    ):
        assert dataclasses.is_dataclass(obj)
        for name in names:
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(obj, name, None)
            with pytest.raises(dataclasses.FrozenInstanceError):
                delattr(obj, name)
