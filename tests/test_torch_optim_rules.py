"""``fzero.from_torch_optim``: torch.optim's per-element classes run on the shards, equal to the
same class on the unsharded model (float64, 1e-10); their state checkpoints, reshards and
moves to and from torch.optim state dicts; classes that cannot run sharded are refused by
name. The gloo run equal to the simulated world is in ``test_distributed.py``
(``torch_nadam``)."""

from __future__ import annotations

import copy

import pytest
import torch

import fzero
import unused_cases as uc
import user_models as um
from fzero.checkpoint import export_torch_optim_state_dict, import_torch_optim_state_dict
from fzero.checkpoint.offline import consolidate_torch_optim_state_dict
from helpers import assert_params_close, batches, children, max_rel_err, mlp, reference_run, train_sharded

STEPS = 5
TOL = 1e-10
SIZES = (7, 9, 5, 3)  # odd: parameters straddle shard boundaries at every W
mse = torch.nn.functional.mse_loss

# non-default values for hyperparameters and static settings alike
CLASSES = {
    "Adamax": (torch.optim.Adamax, dict(lr=0.02, betas=(0.8, 0.99), weight_decay=0.01)),
    "NAdam": (torch.optim.NAdam, dict(lr=0.02, betas=(0.8, 0.99), weight_decay=0.01, momentum_decay=0.01)),
    "RAdam": (torch.optim.RAdam, dict(lr=0.02, betas=(0.8, 0.99), weight_decay=0.01, decoupled_weight_decay=True)),
    "RMSprop": (torch.optim.RMSprop, dict(lr=0.01, alpha=0.9, momentum=0.5, centered=True, weight_decay=0.01)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1, weight_decay=0.01)),
    "ASGD": (torch.optim.ASGD, dict(lr=0.05, lambd=0.01, alpha=0.7, t0=2.0, weight_decay=0.01)),
}
# (W, stage) of the Llama run of each class: together every W and every stage (the MLP runs
# every pair for every class)
LLAMA_RUNS = {"Adamax": ((1, 3),), "NAdam": ((2, 1),), "RAdam": ((3, 2),), "RMSprop": ((4, 3),),
              "Adagrad": ((2, 2),), "ASGD": ((3, 1),)}


def _rule(name: str) -> fzero.torch_optim_rules.TorchOptimRule:
    cls, kw = CLASSES[name]
    return fzero.from_torch_optim(cls, **kw)


def _torch(name: str, params) -> torch.optim.Optimizer:  # noqa: ANN001
    cls, kw = CLASSES[name]
    return cls(params, **kw)


def _train(model, rule, data, world, stage, criterion=mse, state=None, donate=False):  # noqa: ANN001
    """Train ``model`` (a stage-3 state takes over its parameters: give each run its own)."""
    return train_sharded(model, rule, data, world, stage, criterion, state, None, donate)


def _assert_params(state, comm, ref: torch.nn.Module, tol: float = TOL, where=()) -> None:  # noqa: ANN001
    assert_params_close(state, comm, ref, tol, where)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_mlp_equals_torch_optim_at_every_world_and_stage(name):
    for world in (1, 2, 3, 4):
        data = batches(STEPS, world, 2, torch.float64, d_in=SIZES[0])
        ref = reference_run(mlp(torch.float64, sizes=SIZES), lambda m: _torch(name, m.parameters()), data, world)
        for stage in (1, 2, 3):
            # donating (the shards updated in place) at even W
            state, comm = _train(mlp(torch.float64, sizes=SIZES), _rule(name), data, world, stage,
                                 donate=world % 2 == 0)
            assert int(state.opt.step) == STEPS
            _assert_params(state, comm, ref, where=(world, stage))


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_llama_equals_torch_optim(name):
    pytest.importorskip("transformers")
    for world, stage in LLAMA_RUNS[name]:
        data = um.token_batches(STEPS, world * 2)
        ref, _, _ = um.oracle_run(um.llama().double(), lambda m: _torch(name, m.parameters()), data, world,
                                  um.oracle_loss("lm"))
        state, comm = _train(um.llama().double(), _rule(name), data, world, stage, um.lm_criterion)
        _assert_params(state, comm, ref, where=(world, stage))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unused_parameters_keep_their_own_step_and_scalars(stage):
    """NAdam's ``mu_product`` and ASGD's ``eta``/``mu`` are per parameter: a parameter that sat
    out a step (no rank had a gradient) keeps its own, as torch.optim (DDP's semantics)."""
    for opt in ("nadam", "asgd"):
        want = uc.run_oracle(2, opt)
        got = uc.run_fzero(fzero.SimulatedWorld(2), opt, stage)
        for k, v in want.items():
            assert max_rel_err(got["params"][k], v) <= 1e-12, (opt, k)
        assert got["steps"]["branch.weight"] == 4 and got["steps"]["aux.weight"] == 0


def test_a_subclass_and_moments_equal_torch_state():
    """A user's subclass runs as its base class does; the sharded moments and the
    per-parameter scalars, gathered, are torch.optim's own state."""

    class MyNAdam(torch.optim.NAdam):
        pass

    model = mlp(torch.float64, sizes=SIZES)
    world = 3
    data = batches(STEPS, world, 2, torch.float64, d_in=SIZES[0])
    ref_model = mlp(torch.float64, sizes=SIZES)
    ref = _torch("NAdam", ref_model.parameters())
    for x, y in data:
        ref.zero_grad()
        (sum(mse(ref_model(a), b) for a, b in zip(x.chunk(world), y.chunk(world))) / world).backward()
        ref.step()
    rule = fzero.from_torch_optim(MyNAdam, **CLASSES["NAdam"][1])
    assert rule.name.endswith("MyNAdam") and rule.moment_names == ("exp_avg", "exp_avg_sq")
    assert rule.scalar_names == ("mu_product",)
    state, comm = _train(model, rule, data, world, 2)
    _assert_params(state, comm, ref_model)
    lay = state.layout
    params = dict(ref_model.named_parameters())
    for g, moments in zip(lay.groups, state.opt.moments):
        for name, m in zip(rule.moment_names, moments):
            full = m.reshape(-1)
            for i in g.slots:
                s = lay.slots[i]
                got = full[s.offset: s.offset + s.numel].view(s.shape)
                assert max_rel_err(got, ref.state[params[s.path]][name]) <= TOL, (s.path, name)
    for k, s in enumerate(lay.trainable_slots):
        assert state.opt.scalars[0][k].item() == ref.state[params[s.path]]["mu_product"].item()


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_checkpoint_reshards_and_torch_state_dicts_continue(name, tmp_path):
    """Saved at W=2 stage 2, loaded at W=3 stage 3, the run continues as the uninterrupted one;
    the torch.optim state dict exported loads into the torch class, which continues the same;
    imported from the torch run, fzero continues the same."""
    model = mlp(torch.float64, sizes=SIZES)
    data = batches(4, 6, 1, torch.float64, d_in=SIZES[0])
    state, comm2 = _train(model, _rule(name), data[:2], 2, 2)
    fzero.save_checkpoint(state, tmp_path, comm2)
    whole, _ = _train(model, None, data[2:], 2, 2, state=state)
    comm3 = fzero.SimulatedWorld(3)
    model3 = mlp(torch.float64, sizes=SIZES)
    template = fzero.init_train_state(model3, _rule(name), comm3, stage=3, units=children)
    loaded, _ = fzero.load_checkpoint(tmp_path, template, comm3)
    resumed, _ = _train(model3, None, data[2:], 3, 3, state=loaded)
    a, b = fzero.checkpoint.export_model_state_dict(whole, comm2), fzero.checkpoint.export_model_state_dict(resumed, comm3)
    for k in a:
        assert max_rel_err(b[k], a[k]) <= 1e-12, k

    # offline, from the checkpoint alone: the rule rebuilt from its manifest gives the same dict
    _assert_same_state_dict(consolidate_torch_optim_state_dict(tmp_path), export_torch_optim_state_dict(state, comm2))

    # fzero -> torch.optim: the export is the torch class's own state dict after the same steps,
    # and the class continues from it as from its own (torch's load_state_dict casts 0-d state
    # such as NAdam's float32 mu_product to the parameters' dtype, so a reloaded torch run is
    # the reference, not the uninterrupted one)
    ref_model = mlp(torch.float64, sizes=SIZES)
    ref = _torch(name, ref_model.parameters())
    _torch_steps(ref_model, ref, data[:2])
    exported = export_torch_optim_state_dict(state, comm2)
    _assert_same_state_dict(exported, ref.state_dict())
    runs = []
    for sd in (exported, copy.deepcopy(ref.state_dict())):  # load_state_dict shares same-dtype tensors
        twin = mlp(torch.float64, sizes=SIZES)
        twin.load_state_dict(fzero.checkpoint.export_model_state_dict(state, comm2))
        opt = _torch(name, twin.parameters())
        opt.load_state_dict(sd)
        _torch_steps(twin, opt, data[2:])
        runs.append(dict(twin.named_parameters()))
    for n, p in runs[1].items():
        assert torch.equal(runs[0][n], p), n

    # torch.optim -> fzero: imported from the torch run, fzero continues as the torch run
    template2 = fzero.init_train_state(mlp(torch.float64, sizes=SIZES), _rule(name), comm2, alignment=4)
    back = import_torch_optim_state_dict(template2, ref_model.state_dict(), ref.state_dict(), comm2)
    _assert_same_state_dict(export_torch_optim_state_dict(back, comm2), ref.state_dict())
    back, _ = _train(mlp(torch.float64, sizes=SIZES), None, data[2:], 2, 2, state=back)
    _torch_steps(ref_model, ref, data[2:])
    _assert_params(back, comm2, ref_model)


def _torch_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, data: list, world: int = 2) -> None:
    for x, y in data:
        opt.zero_grad()
        (sum(mse(model(a), b) for a, b in zip(x.chunk(world), y.chunk(world))) / world).backward()
        opt.step()


def _assert_same_state_dict(got: dict, want: dict) -> None:
    """Every per-parameter entry bitwise (dtype included), and the param groups equal."""
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for pid, st in want["state"].items():
        assert got["state"][pid].keys() == st.keys(), pid
        for k, v in st.items():
            mine = got["state"][pid][k]
            assert mine.dtype == v.dtype and torch.equal(mine, v), (pid, k)


def test_classes_that_cannot_run_sharded_are_refused_by_name():
    with pytest.raises(ValueError, match="LBFGS cannot run on shards: its step.. needs a closure"):
        fzero.from_torch_optim(torch.optim.LBFGS, lr=0.1)
    with pytest.raises(ValueError, match="SparseAdam cannot run on shards: .*dense"):
        fzero.from_torch_optim(torch.optim.SparseAdam, lr=0.1)

    class RowScaled(torch.optim.Optimizer):
        """Keeps a per-row statistic: not per-element."""

        def __init__(self, params, lr=0.1):  # noqa: ANN001
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None):  # noqa: ANN001, ANN201
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.state[p]
                    st["row_norm"] = p.grad.norm(dim=-1, keepdim=True)
                    p.sub_(group["lr"] * p.grad / st["row_norm"])

    with pytest.raises(ValueError, match=r"RowScaled cannot run on shards: its state 'row_norm' is a tensor "
                                         r"of shape \(2, 1\), neither per-element"):
        fzero.from_torch_optim(RowScaled, lr=0.1)
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer subclass"):
        fzero.from_torch_optim(fzero.adamw)


def test_compiled_step_and_other_checkpoints_are_refused_by_name(tmp_path):
    model = mlp(torch.float64, sizes=SIZES)
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, _rule("NAdam"), comm)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=True)
    batch = comm.split_batch(batches(1, 2, 2, torch.float64, d_in=SIZES[0])[0])
    with pytest.raises(ValueError, match=r"optimizer torch.optim.nadam.NAdam cannot run in a compiled step"):
        step(state, batch)
    fzero.save_checkpoint(state, tmp_path, comm)
    for other, diff in ((_rule("RAdam"), "optimizer kind: 'torch.optim.nadam.NAdam' vs 'torch.optim.radam.RAdam'"),
                        (fzero.from_torch_optim(torch.optim.NAdam, maximize=True), "optimizer static")):
        with pytest.raises(fzero.checkpoint.CheckpointMismatchError, match=diff):
            fzero.load_checkpoint(tmp_path, fzero.init_train_state(model, other, comm), comm)


def test_scalars_are_replica_checked_and_in_the_signature():
    """The per-parameter scalars are replicated state: the replica check digests them; the
    signature (replica check, manifest) carries the probed state layout and static settings."""
    from fzero.replicas import replica_items

    model = mlp(torch.float64, sizes=SIZES)
    state = fzero.init_train_state(model, _rule("ASGD"), fzero.SimulatedWorld(2))
    names = [name for name, _, _ in replica_items(state)]
    assert "opt.scalars['eta']" in names and "opt.scalars['mu']" in names
    assert state.opt.scalars[0].shape == (len(state.layout.trainable_slots),)
    nadam = _rule("NAdam")
    assert nadam.signature != fzero.from_torch_optim(torch.optim.NAdam, **CLASSES["NAdam"][1], maximize=True).signature
    assert "mu_product" in nadam.signature and nadam.signature == _rule("NAdam").signature


def _no_decay(path: str) -> bool:
    return path.endswith("bias") or path.startswith("2.")  # biases and the LayerNorm


def test_param_groups_and_changed_hyperparameters_follow_torch():
    """Per-group overrides (the torch class's param groups) and a learning rate changed every
    step (``set_hyperparams``, torch's ``param_group["lr"]``) give torch's numbers; a NaN
    override is refused."""
    cls, kw = CLASSES["RAdam"]
    world, lrs = 3, [0.02 * 0.7**i for i in range(STEPS)]
    data = batches(STEPS, world, 2, torch.float64, d_in=SIZES[0])
    ref_model = mlp(torch.float64, sizes=SIZES)
    named = list(ref_model.named_parameters())
    ref = cls([{"params": [p for n, p in named if not _no_decay(n)]},
               {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0, "lr": 0.01}], **kw)
    rule = fzero.from_torch_optim(cls, groups=[(_no_decay, {"weight_decay": 0.0, "lr": 0.01})], **kw)
    model = mlp(torch.float64, sizes=SIZES)
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, rule, comm, alignment=4)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    for lr, batch in zip(lrs, data):
        ref.param_groups[0]["lr"] = lr
        _torch_steps(ref_model, ref, [batch], world)
        state = fzero.pytree.replace(state, opt=fzero.optim.set_hyperparams(state.opt, group=0, lr=lr))
        state, _ = step(state, comm.split_batch(batch))
    _assert_params(state, comm, ref_model)
    with pytest.raises(ValueError, match="param group 1: invalid lr nan"):
        fzero.from_torch_optim(cls, groups=[(_no_decay, {"lr": float("nan")})], **kw)


class CountedSGD(torch.optim.Optimizer):
    """A user's class whose per-parameter scalar state is a Python number (``calls``)."""

    def __init__(self, params, lr=0.1):  # noqa: ANN001
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["calls"] = st.get("calls", 0) + 1
                st["avg"] = st.get("avg", torch.zeros_like(p)).lerp_(p.grad, 0.5)
                p.sub_(group["lr"] / st["calls"] * st["avg"])


def test_scalar_state_dtypes_follow_the_class():
    """0-d state is injected as the class keeps it: Python numbers as numbers (a user's
    class, equal to it when trained), tensors in the dtype torch gives them (float64 under a
    float64 default dtype, as torch's ``_get_scalar_dtype``)."""
    rule = fzero.from_torch_optim(CountedSGD, lr=0.1)
    assert rule.scalar_names == ("calls",) and rule.scalar_dtype is None
    world = 3
    data = batches(STEPS, world, 2, torch.float64, d_in=SIZES[0])
    ref = reference_run(mlp(torch.float64, sizes=SIZES), lambda m: CountedSGD(m.parameters(), lr=0.1), data, world)
    state, comm = _train(mlp(torch.float64, sizes=SIZES), rule, data, world, 2)
    _assert_params(state, comm, ref)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert fzero.from_torch_optim(torch.optim.NAdam).scalar_dtype == torch.float64
    finally:
        torch.set_default_dtype(default)
    assert fzero.from_torch_optim(torch.optim.NAdam).scalar_dtype == torch.float32


def test_a_class_recording_more_defaults_than_it_takes_runs():
    """AdamW records ``decoupled_weight_decay=True`` in its defaults, an argument only Adam's
    constructor takes; the rule rebuilds the class every step from what its constructor takes."""
    kw = dict(lr=0.02, betas=(0.8, 0.99), weight_decay=0.05)
    rule = fzero.from_torch_optim(torch.optim.AdamW, **kw)
    assert "decoupled_weight_decay" not in dict(rule.static)
    data = batches(STEPS, 2, 2, torch.float64, d_in=SIZES[0])
    ref = reference_run(mlp(torch.float64, sizes=SIZES), lambda m: torch.optim.AdamW(m.parameters(), **kw), data, 2)
    state, comm = _train(mlp(torch.float64, sizes=SIZES), rule, data, 2, 2)
    _assert_params(state, comm, ref)
