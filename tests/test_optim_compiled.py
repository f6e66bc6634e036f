"""Every update rule path against ``torch.optim`` in float64, eagerly and compiled.

Which code runs where (``fzero/optim.py``, ``fzero/sharding.py::shard_step``):

* eager and compiled, ``donate=False`` (on clones) or ``True``:
  ``Optimizer.update_`` -> torch's fused Adam(W) kernel (the ``fzero::fused_adam_``
  operator), or the written-out SGD rule copied back;
* parameters that sat out steps: ``Optimizer.update`` with per-element step
  scalars, selected by ``torch.where``.

One compiled function runs both shard_step forms, so each static flag set
compiles once. The reference is ``torch.optim`` (single-tensor implementation)
on the full parameter; fzero's two ranks each update their half.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import fzero
from fzero.pytree import replace

N = 37  # odd: rank 1 owns one padding element; not a multiple of any vector width
W = 2
STEPS = 4
SKIP_AT = 2  # found_inf on this step: nothing may change
RTOL = 1e-12

# (name, fzero optimizer, torch.optim class, torch kwargs): every static flag set,
# with non-default values for every hyperparameter.
CASES = [
    ("sgd_wd", fzero.sgd(lr=0.1, weight_decay=0.05), torch.optim.SGD, dict(lr=0.1, weight_decay=0.05)),
    ("sgd_maximize", fzero.sgd(lr=0.1, weight_decay=0.05, maximize=True), torch.optim.SGD,
     dict(lr=0.1, weight_decay=0.05, maximize=True)),
    ("sgd_momentum_dampening", fzero.sgd(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.05),
     torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.05)),
    ("sgd_nesterov_maximize", fzero.sgd(lr=0.1, momentum=0.8, weight_decay=0.05, nesterov=True, maximize=True),
     torch.optim.SGD, dict(lr=0.1, momentum=0.8, weight_decay=0.05, nesterov=True, maximize=True)),
    ("adam_wd", fzero.adam(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1), torch.optim.Adam,
     dict(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1)),
    ("adam_amsgrad", fzero.adam(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1, amsgrad=True),
     torch.optim.Adam, dict(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1, amsgrad=True)),
    ("adam_maximize_amsgrad", fzero.adam(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1, amsgrad=True,
                                         maximize=True),
     torch.optim.Adam, dict(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1, amsgrad=True, maximize=True)),
    ("adamw_wd", fzero.adamw(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.3), torch.optim.AdamW,
     dict(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.3)),
    ("adamw_maximize", fzero.adamw(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.3, maximize=True),
     torch.optim.AdamW, dict(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.3, maximize=True)),
    ("adamw_amsgrad", fzero.adamw(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.3, amsgrad=True),
     torch.optim.AdamW, dict(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.3, amsgrad=True)),
]


def _data():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(N, generator=g, dtype=torch.float64)
    # Gradients of varied sign and magnitude; some shrink so that amsgrad's maximum matters.
    grads = [torch.randn(N, generator=g, dtype=torch.float64) * (2.0 if i == 0 else 0.5 ** i) for i in range(STEPS)]
    return w, grads


def _torch_reference(cls, kw):
    w, grads = _data()
    p = w.clone().requires_grad_(True)
    opt = cls([p], foreach=False, **kw)
    for i, g in enumerate(grads):
        if i == SKIP_AT:
            continue
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _shards(full: torch.Tensor, shard_numel: int) -> torch.Tensor:
    padded = torch.zeros(W * shard_numel, dtype=full.dtype)
    padded[: full.numel()] = full
    return padded.reshape(W, shard_numel)


def _both_steps(shard, opt_state, grads, found_inf, comm=None):
    """shard_step pure and donating (on copies) in one function: one compile covers both paths.
    Compiled, it is given the traced communicator (who compiles says so: ``comm.tracing()``)."""
    pure = fzero.shard_step(shard, opt_state, grads, found_inf, comm=comm)
    donor = replace(shard, master=tuple(m.clone() for m in shard.master))
    donor_opt = replace(opt_state, moments=tuple(tuple(x.clone() for x in mm) for mm in opt_state.moments))
    donated = fzero.shard_step(donor, donor_opt, grads, found_inf, donate=True, comm=comm)
    return pure, donated


@pytest.fixture(scope="module")
def compiled_both():
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # torch < 2.7
    limit = getattr(cfg, name)
    setattr(cfg, name, 64)  # one graph per static flag set
    try:
        traced = fzero.SimulatedWorld(W).tracing()
        yield torch.compile(lambda *args: _both_steps(*args, comm=traced), fullgraph=True)
    finally:
        setattr(cfg, name, limit)


def _run_fzero(opt, step_fn, found_inf_none=False):
    w, grads = _data()
    comm = fzero.SimulatedWorld(W)
    shard = fzero.init_shard({"w": w}, comm, optimizer=opt, alignment=1)
    opt_state = fzero.optim.init_opt_state(opt, shard.master)
    n = shard.master[0].shape[1]
    history = []
    for i, g in enumerate(grads):
        skip = i == SKIP_AT
        gs = (_shards(torch.full_like(g, float("nan")) if skip else g, n),)
        if found_inf_none and not skip:
            found = None
        else:
            found = torch.tensor(1.0 if skip else 0.0)
        (p_shard, p_opt), (d_shard, d_opt) = step_fn(shard, opt_state, gs, found)
        history.append((shard, opt_state, p_shard, p_opt, d_shard, d_opt, skip))
        shard, opt_state = p_shard, p_opt
    return history


def _full(shard) -> torch.Tensor:
    return shard.master[0].reshape(-1)[:N]


def _check(history, expected, bitwise_pure_vs_donated):
    for before, before_opt, p_shard, p_opt, d_shard, d_opt, skip in history:
        for tag, s, o in (("pure", p_shard, p_opt), ("donated", d_shard, d_opt)):
            if skip:
                assert torch.equal(s.master[0], before.master[0]), tag
                for a, b in zip(o.moments[0], before_opt.moments[0]):
                    assert torch.equal(a, b), tag
                assert int(o.step) == int(before_opt.step), tag
            else:
                assert int(o.step) == int(before_opt.step) + 1, tag
            # padding stays zero in the master and every moment
            assert s.master[0][1, -1].item() == 0.0
            for m in o.moments[0]:
                assert m[1, -1].item() == 0.0
        if bitwise_pure_vs_donated:
            assert torch.equal(p_shard.master[0], d_shard.master[0])
            for a, b in zip(p_opt.moments[0], d_opt.moments[0]):
                assert torch.equal(a, b)
        else:
            torch.testing.assert_close(p_shard.master[0], d_shard.master[0], rtol=RTOL, atol=0)
    final = history[-1]
    for tag, s in (("pure", final[2]), ("donated", final[4])):
        got = _full(s)
        err = ((got - expected).abs().max() / expected.abs().max()).item()
        assert err <= RTOL, (tag, err)


@pytest.mark.parametrize("name,opt,cls,kw", CASES, ids=[c[0] for c in CASES])
def test_eager_update_matches_torch_optim_float64(name, opt, cls, kw):
    expected = _torch_reference(cls, kw)
    _check(_run_fzero(opt, _both_steps), expected, bitwise_pure_vs_donated=True)
    # without a found_inf tensor at all (the step count advances unconditionally)
    _check(_run_fzero(opt, _both_steps, found_inf_none=True), expected, bitwise_pure_vs_donated=True)


@pytest.mark.parametrize("name,opt,cls,kw", CASES, ids=[c[0] for c in CASES])
def test_out_of_place_update_eagerly_matches_torch_optim(name, opt, cls, kw):
    """``Optimizer.update`` called directly (the written-out rule, eagerly), one row per rank."""
    expected = _torch_reference(cls, kw)
    w, grads = _data()
    p = torch.stack([w, -w])  # two independent rows: the second sees negated data
    moments = tuple(torch.zeros_like(p) for _ in opt.moment_names)
    state = fzero.optim.init_opt_state(opt, [p])
    step = torch.zeros((), dtype=torch.int64)
    for i, g in enumerate(grads):
        if i == SKIP_AT:
            continue
        g2 = torch.stack([g, -g])
        p, moments = opt.update(p, g2, moments, state.hyper[0], step)
        step = step + 1
    assert len(moments) == len(opt.moment_names)
    for row, sign in ((0, 1.0), (1, -1.0)):
        err = ((p[row] * sign - expected).abs().max() / expected.abs().max()).item()
        assert err <= RTOL, (row, err)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_fused_update_of_rows_equals_each_row_alone(kind, amsgrad):
    """A simulated world's ``[R, n]`` shard updates each row exactly as a real rank updates
    its own ``[1, n]`` tensor. torch's fused kernel splits a tensor into vector blocks and a
    scalar tail that may round differently; called on the whole ``[R, n]`` buffer it put the
    end of a row in a vector block where a real rank has its tail (the gloo bitwise test failed).
    """
    make = fzero.adam if kind == "adam" else fzero.adamw
    opt = make(lr=0.01, betas=(0.9, 0.999), weight_decay=0.1, amsgrad=amsgrad)
    g = torch.Generator().manual_seed(0)
    R, n = 8, 76  # 76 = 4 * 16 + 12: every row has a tail on its own
    p = torch.randn(R, n, generator=g)
    moments = tuple(torch.zeros(R, n) for _ in opt.moment_names)
    state = fzero.optim.init_opt_state(opt, [p])
    rows = [(p[r : r + 1].clone(), tuple(m[r : r + 1].clone() for m in moments)) for r in range(R)]
    for step in range(6):
        grad = torch.randn(R, n, generator=g) * 10.0 ** -step
        opt.update_(p, grad, moments, state.hyper[0], torch.tensor(step))
        for r, (pr, mr) in enumerate(rows):
            opt.update_(pr, grad[r : r + 1].clone(), mr, state.hyper[0], torch.tensor(step))
    for r, (pr, mr) in enumerate(rows):
        assert torch.equal(pr[0], p[r]), r
        for a, b in zip(mr, moments):
            assert torch.equal(a[0], b[r]), r


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_beta1_zero_is_accepted_and_matches_torch(kind):
    """beta1 = 0 (no first moment) is valid in torch.optim and here."""
    make, cls = (fzero.adam, torch.optim.Adam) if kind == "adam" else (fzero.adamw, torch.optim.AdamW)
    kw = dict(lr=0.05, betas=(0.0, 0.95), eps=1e-3, weight_decay=0.1)
    opt = make(**kw)
    assert dict(opt.defaults)["beta1"] == 0.0
    expected = _torch_reference(cls, kw)
    _check(_run_fzero(opt, _both_steps), expected, bitwise_pure_vs_donated=True)


def test_group_names():
    opt = fzero.adamw(groups=[
        fzero.optim.ParamGroup(fzero.optim.no_weight_decay, (("weight_decay", 0.0),), name="no_decay"),
        (lambda p: p.startswith("head"), {"lr": 0.5}),
    ])
    assert opt.num_groups == 3
    assert [opt.group_name(i) for i in range(3)] == ["default", "no_decay", "group2"]
    assert opt.group_of("head.weight") == 2 and opt.group_of("x.bias") == 1 and opt.group_of("x.weight") == 0
    assert opt.hyperparams(2)["lr"] == 0.5 and opt.hyperparams(0)["lr"] == 1e-3
    assert opt.hyperparams(1)["weight_decay"] == 0.0 and opt.hyperparams(0)["weight_decay"] == 1e-2


# Last: compiling is the slow part (tools/mutate.py runs this file with -x).
@pytest.mark.parametrize("name,opt,cls,kw", CASES, ids=[c[0] for c in CASES])
def test_compiled_update_matches_torch_optim_float64(name, opt, cls, kw, compiled_both):
    expected = _torch_reference(cls, kw)
    _check(_run_fzero(opt, compiled_both), expected, bitwise_pure_vs_donated=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


@pytest.mark.parametrize("found", [1.0, 2.0, float("nan"), float("inf")])
@pytest.mark.parametrize("kind,amsgrad", [("adam", True), ("adamw", False), ("adamw", True)])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_skipped_step_leaves_every_bit(mode, kind, amsgrad, found, compiled_both):
    """Any nonzero found_inf skips (torch's fused kernel itself tests == 1.0 only), with NaN
    and inf gradients, on a state holding a NaN payload, infinities and -0.0: the pure and
    the donated step return every bit of their input, and the step count holds."""
    make = fzero.adam if kind == "adam" else fzero.adamw
    opt = make(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1, amsgrad=amsgrad)
    comm = fzero.SimulatedWorld(W)
    g = torch.Generator().manual_seed(3)
    shard = fzero.init_shard({"w": torch.randn(N, generator=g)}, comm, optimizer=opt, alignment=1)
    n = shard.master[0].shape[1]
    special = torch.tensor([0x7FC01234, 0xFF800000 - 2**32, 0x7F800000, -(2**31)], dtype=torch.int32)
    special = special.view(torch.float32)  # NaN with a payload, -inf, inf, -0.0
    master = shard.master[0].clone()
    master[0, :4] = special
    moments = tuple(torch.rand(W, n, generator=g) for _ in opt.moment_names)
    for m in moments:
        m[1, :4] = special
    shard = replace(shard, master=(master,))
    state = replace(fzero.optim.init_opt_state(opt, shard.master), step=torch.tensor(3), moments=(moments,))
    grad = torch.randn(W, n, generator=g)
    grad[0, ::2] = float("nan")
    grad[1, ::3] = -float("inf")
    before = [_bits(t).clone() for t in (master, *moments)]
    step_fn = _both_steps if mode == "eager" else compiled_both
    pure, donated = step_fn(shard, state, (grad,), torch.tensor(found))
    for s, o in (pure, donated, (shard, state)):  # and the pure step's input
        for b, t in zip(before, (s.master[0], *o.moments[0])):
            assert torch.equal(b, _bits(t))
        assert int(o.step) == 3


def _pure_and_donated(shard, opt_state, grads, found_inf):
    return _both_steps(shard, opt_state, grads, found_inf, comm=TRACED)


TRACED = fzero.SimulatedWorld(W).tracing()


def test_compiled_step_does_not_recompile_as_hyperparameters_change():
    """Every hyperparameter and the step count are tensor inputs of the compiled AdamW step:
    changing lr, betas, eps and weight decay and skipping a step run the same graph, and each
    step equals the eager (fused-kernel) step bit for bit, pure and donated alike."""
    opt = fzero.adamw(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.3)
    comm = fzero.SimulatedWorld(W)
    w, grads = _data()
    shard = fzero.init_shard({"w": w}, comm, optimizer=opt, alignment=1)
    state = fzero.optim.init_opt_state(opt, shard.master)
    n = shard.master[0].shape[1]
    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    compiled = torch.compile(_pure_and_donated, fullgraph=True)
    changes = [dict(lr=0.01), dict(beta1=0.5, beta2=0.9), dict(weight_decay=0.0, eps=1e-6), dict(lr=0.2)]
    eager_shard, eager_state = shard, state
    for i in range(8):
        gs = (_shards(grads[i % STEPS] * (-1) ** i, n),)
        found = torch.tensor(float(i == 5))
        (eager_shard, eager_state), _ = _both_steps(eager_shard, eager_state, gs, found)
        (p_shard, p_state), (d_shard, d_state) = compiled(shard, state, gs, found)
        for a, b in zip((p_shard.master[0], *p_state.moments[0]), (d_shard.master[0], *d_state.moments[0])):
            assert torch.equal(a, b)
        for a, b in zip((p_shard.master[0], *p_state.moments[0]), (eager_shard.master[0], *eager_state.moments[0])):
            assert torch.equal(a, b)  # one kernel, fzero::fused_adam_, eagerly and compiled
        assert int(p_state.step) == int(eager_state.step) == i + (i < 5)
        new = changes[i % len(changes)]
        shard, state = p_shard, fzero.optim.set_hyperparams(p_state, **new)
        eager_state = fzero.optim.set_hyperparams(eager_state, **new)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert sum(counters["recompiles"].values()) == recompiles
