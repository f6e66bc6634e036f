"""Deterministic cases for behaviour that mutation testing (``tools/mutate.py``) found unpinned."""

from __future__ import annotations

import torch

import fzero
import pytest

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
    st = fzero.init_opt_state(opt, master)
    assert st.step.dtype == torch.int64 and int(st.step) == 0
    assert [h["lr"].item() for h in st.hyper] == [0.1, 0.2]
    assert all(v.dtype == torch.float64 and v.shape == () for h in st.hyper for v in h.values())
    for m, mm in zip(master, st.moments):
        assert len(mm) == 2 and all(x.shape == m.shape and x.dtype == m.dtype and not x.any() for x in mm)
    one = fzero.set_hyperparams(st, group=1, lr=0.5)
    assert one.hyper[1]["lr"].item() == 0.5 and one.hyper[0]["lr"].item() == 0.1
    assert st.hyper[1]["lr"].item() == 0.2  # the input state is unchanged
    both = fzero.set_hyperparams(st, lr=torch.tensor(0.7, dtype=torch.float32), weight_decay=0.0)
    assert [h["lr"].item() for h in both.hyper] == pytest.approx([0.7, 0.7])
    assert all(h["lr"].dtype == torch.float64 and h["weight_decay"].item() == 0.0 for h in both.hyper)
    with pytest.raises(ValueError, match="no param group 2"):
        fzero.set_hyperparams(st, group=2, lr=0.1)
    with pytest.raises(ValueError, match="no param group -1"):
        fzero.set_hyperparams(st, group=-1, lr=0.1)
    with pytest.raises(ValueError, match="'momentum'"):
        fzero.set_hyperparams(st, momentum=0.1)


def test_no_weight_decay_by_name():
    nwd = fzero.no_weight_decay
    assert nwd("bias") and nwd("layer.bias") and nwd("ln_f.weight") and nwd("bn1.weight")
    assert nwd("block.norm.weight") and nwd("block.LayerNorm.weight")
    assert not nwd("weight") and not nwd("fc.weight") and not nwd("head.weight")
    assert not nwd("a.ln.b.weight")  # only the parent module's name counts


def test_no_weight_decay_for_module_types():
    m = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 1, bias=False),
                            torch.nn.BatchNorm1d(1), torch.nn.RMSNorm(1), torch.nn.GroupNorm(1, 1))
    pred = fzero.no_weight_decay_for(m)
    assert pred("0.bias") and pred("1.weight") and pred("1.bias") and pred("3.weight") and pred("4.weight")
    assert pred("5.weight")
    assert not pred("0.weight") and not pred("2.weight")
