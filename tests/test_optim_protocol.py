"""The update-rule protocol (``fzero.Optimizer``): a user's rule written in a few lines (Lion)
trains at stages 1, 2 and 3, eagerly and compiled (one graph, no recompiles while its
hyperparameters change), equal to a plain-torch float64 reference on the unsharded model;
and what fzero reads through the protocol (signature, manifest, checkpoints) follows it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

import fzero
import fzero.checkpoint
from helpers import CHEAP_COMPILE, batches, children, max_rel_err, mlp

W = 2
STEPS = 4
LR, BETA1, BETA2, WD = 0.01, 0.9, 0.99, 0.1
SIZES = (7, 9, 5, 3)  # odd: parameters straddle shard boundaries


@dataclasses.dataclass(frozen=True)
class Lion(fzero.Optimizer):
    """Lion (Chen et al., 2023): step along the sign of an interpolated momentum."""

    moment_names = ("exp_avg",)

    def update(self, p, g, moments, hyper, step, per_element=None):  # noqa: ANN001, ANN201
        h = fzero.optim.hyper_scalars(hyper, p.dtype)
        (m,) = moments
        direction = torch.lerp(m, g, 1 - h["beta1"]).sign()
        new_p = p * (1 - h["lr"] * h["weight_decay"]) - h["lr"] * direction
        return new_p, (torch.lerp(m, g, 1 - h["beta2"]),)


@dataclasses.dataclass(frozen=True)
class BiasCorrectedAdamW(fzero.Optimizer):
    """AdamW written as a user would: what depends on the step count is in ``step_scalars``,
    so parameters that sat out steps (their own, smaller count) are exact too."""

    moment_names = ("m", "v")
    step_scalar_names = ("c1", "c2")

    def step_scalars(self, hyper, steps):  # noqa: ANN001, ANN201
        t = (steps + 1).to(torch.float64)
        return torch.stack([1 - hyper["beta1"] ** t, (1 - hyper["beta2"] ** t).sqrt()], dim=1)

    def update(self, p, g, moments, hyper, step, per_element=None):  # noqa: ANN001, ANN201
        h = fzero.optim.hyper_scalars(hyper, p.dtype)
        s = self.step_values(hyper, step, per_element, p.dtype)
        m = torch.lerp(moments[0], g, 1 - h["beta1"])
        v = moments[1] * h["beta2"] + (1 - h["beta2"]) * g * g
        denom = v.sqrt() / s["c2"] + h["eps"]
        return p * (1 - h["lr"] * h["weight_decay"]) - (h["lr"] / s["c1"]) * (m / denom), (m, v)


def lion(**kw: float) -> Lion:
    return Lion.configure(**{**dict(lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=WD), **kw})


def _lrs() -> list[float]:
    return [LR * 0.5**i for i in range(STEPS)]  # changed every step: a schedule, no recompile


def lion_reference(model: torch.nn.Module, data: list, world: int) -> torch.nn.Module:
    """Plain torch, float64, unsharded: the gradient averaged over ``world`` ranks' batches,
    then Lion written from its paper."""
    model = copy.deepcopy(model)
    m = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for lr, (x, y) in zip(_lrs(), data):
        model.zero_grad()
        losses = [torch.nn.functional.mse_loss(model(a), b) for a, b in zip(x.chunk(world), y.chunk(world))]
        (sum(losses) / world).backward()
        with torch.no_grad():
            for n, p in model.named_parameters():
                g = p.grad
                p.mul_(1 - lr * WD).sub_(lr * (BETA1 * m[n] + (1 - BETA1) * g).sign())
                m[n] = BETA2 * m[n] + (1 - BETA2) * g
    return model


def _train(model, data, stage, compile):
    comm = fzero.SimulatedWorld(W)
    units = {"units": children} if stage == 3 else {}
    state = fzero.init_train_state(model, lion(), comm, stage=stage, alignment=4, **units)
    step = fzero.make_train_step(fzero.module_loss(model, torch.nn.functional.mse_loss), comm,
                                 compile=compile)
    for lr, batch in zip(_lrs(), data):
        state = dataclasses.replace(state, opt=fzero.optim.set_hyperparams(state.opt, lr=lr))
        state, metrics = step(state, comm.split_batch(batch))
        assert metrics["found_inf"].item() == 0.0
    return state, comm


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_user_rule_lion_trains_at_every_stage_like_plain_torch(compile):
    model = mlp(torch.float64, sizes=SIZES)
    data = batches(STEPS, W, 2, torch.float64, d_in=SIZES[0])
    ref = dict(lion_reference(model, data, W).named_parameters())
    for stage in (1, 2, 3):
        if compile:
            torch._dynamo.reset()
            counters.clear()
        # a fresh module per stage: a compiled step keeps weak references to the module it ran,
        # and stage 3 takes the module's parameters
        # compiled: the rule through inductor at stage 2, the other stages on helpers.CHEAP_COMPILE
        how = (True if stage == 2 else CHEAP_COMPILE) if compile else False
        state, comm = _train(copy.deepcopy(model), data, stage, how)
        if compile:
            assert counters["stats"]["unique_graphs"] == 1, stage
            assert not counters["recompiles"] and not counters["graph_break"], stage
        assert int(state.opt.step) == STEPS
        full = fzero.full_params(state.shard, comm)
        for n, p in ref.items():
            for r in range(W):
                assert max_rel_err(full[n][r], p.detach()) <= 1e-10, (stage, n, r)
        # the moment is sharded like the master, padding zero
        assert all(m.shape == s.shape for m, s in zip((ms[0] for ms in state.opt.moments), state.shard.master))


def test_signature_and_manifest_follow_static_configuration():
    assert lion().name == "lion" and fzero.adamw().name == "adamw"
    assert lion().signature == lion(lr=0.5).signature  # hyperparameters are not static
    assert fzero.adam().signature != fzero.adam(amsgrad=True).signature
    assert fzero.adam().signature != fzero.adamw().signature
    # the built-ins keep the manifest of earlier checkpoints
    assert fzero.sgd(momentum=0.9).manifest() == {"kind": "sgd", "nesterov": False, "maximize": False,
                                                  "amsgrad": False, "momentum_buffer": True}
    assert lion().manifest() == {"kind": "lion"}
    with pytest.raises(ValueError, match="unknown hyperparameter 'beta3'"):
        Lion.configure(lr=0.1, groups=[(lambda p: True, {"beta3": 0.5})])
    with pytest.raises(ValueError, match="invalid lr -1"):
        lion(lr=-1.0)


def test_user_rule_checkpoint_reshards_and_names_another_optimizer(tmp_path):
    """Lion's moment is saved per parameter, loads into another world size and stage, and
    continues exactly; an AdamW template is refused naming both rules."""
    model = mlp(torch.float64, sizes=SIZES)
    data = batches(STEPS, 6, 1, torch.float64, d_in=SIZES[0])
    comm2 = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, lion(), comm2, alignment=4)
    loss = fzero.module_loss(model, torch.nn.functional.mse_loss)
    step2 = fzero.make_train_step(loss, comm2)
    for batch in data[:2]:
        state, _ = step2(state, comm2.split_batch(batch))
    fzero.save_checkpoint(state, tmp_path, comm2)
    for batch in data[2:]:
        state, _ = step2(state, comm2.split_batch(batch))
    comm3 = fzero.SimulatedWorld(3)
    model3 = copy.deepcopy(model)  # a stage-3 state takes over its module's parameters
    template = fzero.init_train_state(model3, lion(), comm3, stage=3, units=children)
    loaded, _ = fzero.load_checkpoint(tmp_path, template, comm3)
    step3 = fzero.make_train_step(fzero.module_loss(model3, torch.nn.functional.mse_loss), comm3)
    for batch in data[2:]:
        loaded, _ = step3(loaded, comm3.split_batch(batch))
    a, b = fzero.checkpoint.export_model_state_dict(state, comm2), fzero.checkpoint.export_model_state_dict(loaded, comm3)
    for k in a:
        assert max_rel_err(b[k], a[k]) <= 1e-12, k
    other = fzero.init_train_state(model, fzero.adamw(), comm3)
    with pytest.raises(fzero.checkpoint.CheckpointMismatchError, match="optimizer kind: 'lion' vs 'adamw'"):
        fzero.load_checkpoint(tmp_path, other, comm3)
    with pytest.raises(fzero.checkpoint.CheckpointMismatchError, match="lion has no torch.optim equivalent"):
        fzero.checkpoint.export_torch_optim_state_dict(state, comm2)


def test_user_rule_with_step_scalars_is_exact_for_unused_parameters(monkeypatch):
    """A parameter no rank had a gradient for sits the step out and keeps its own count: the
    user's rule gets that count's scalars through ``step_scalars``, equal to torch.optim.AdamW
    under DDP's semantics (a data-dependent branch sits out one step). The compiled form of
    this path (one pass over the shard) is the built-ins' (``test_unused_params.py``)."""
    import unused_cases as uc

    mine = lambda: BiasCorrectedAdamW.configure(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,  # noqa: E731
                                                weight_decay=0.1)
    monkeypatch.setitem(uc.OPTIMIZERS, "mine", (mine, uc.OPTIMIZERS["adamw"][1]))
    want = uc.run_oracle(2, "adamw")
    got = uc.run_fzero(fzero.SimulatedWorld(2), "mine", 2)
    for k, v in want.items():
        assert max_rel_err(got["params"][k], v) <= 1e-10, k
    assert got["steps"]["aux.weight"] == 0 and got["steps"]["branch.weight"] == uc.STEPS - 1
