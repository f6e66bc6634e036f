"""bf16 compute with BatchNorm: ``MixedPrecision.keep_dtype`` keeps BatchNorm's parameters in
float32 (torch's batch_norm rejects bf16 weights with float32 running statistics).

A BatchNorm CNN and a BatchNorm1d MLP train at stages 1-3, eager and compiled, against a
plain-torch oracle that emulates each rank (BatchNorm parameters float32, the rest cast to
bf16, the input cast to bf16, logits upcast for the loss), averages the float32 gradients over
ranks as DDP does and steps torch.optim on float32 masters; ``keep_dtype=()`` is a clear
``ValueError``; the layout and ``memory_report`` see the two compute dtypes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fzero
import user_models as um
from fzero.layout import compute_dtype
from fzero.scopes import GATHER, GRAD_BUCKETS
from fzero.testing import Census
from helpers import CHEAP_COMPILE, max_rel_err, run_steps

BF16 = torch.bfloat16
WORLD = 2
STEPS = 4
BN = torch.nn.modules.batchnorm._BatchNorm


def checked(cls: type) -> type:
    """``cls`` (a BatchNorm class) that raises unless it computes with float32 weights on a bf16
    input: in a compiled step the check is a constant of the trace, so it holds inside the graph."""

    class Checked(cls):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.weight.dtype != torch.float32 or x.dtype != BF16:
                raise TypeError(f"{type(self).__name__}: weight {self.weight.dtype}, input {x.dtype}")
            return super().forward(x)

    Checked.__name__ = f"Checked{cls.__name__}"
    return Checked


CheckedBatchNorm1d, CheckedBatchNorm2d = checked(torch.nn.BatchNorm1d), checked(torch.nn.BatchNorm2d)


class ConvNet(torch.nn.Module):
    """conv + BatchNorm2d + ReLU blocks, a pooled linear head."""

    def __init__(self, c: int = 4, classes: int = 5):
        super().__init__()
        self.blocks = torch.nn.Sequential(*(
            torch.nn.Sequential(torch.nn.Conv2d(a, c, 3, padding=1), CheckedBatchNorm2d(c), torch.nn.ReLU())
            for a in (3, c, c)))
        self.head = torch.nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(dim=(2, 3)))


def convnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return ConvNet().train()


def bn_mlp() -> torch.nn.Module:
    """A BatchNorm1d first (its parameters are the model's first: the inputs are still cast to
    bf16), then Linear + BatchNorm1d + ReLU blocks."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        CheckedBatchNorm1d(6),
        torch.nn.Linear(6, 16), CheckedBatchNorm1d(16), torch.nn.ReLU(),
        torch.nn.Linear(16, 16), CheckedBatchNorm1d(16), torch.nn.ReLU(),
        torch.nn.Linear(16, 5),
    ).train()


def vector_batches(n: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 5, (batch,), generator=g)) for _ in range(n)]


def CNN_UNITS(name: str, m: torch.nn.Module) -> bool:
    """Stage 3's shard units of the ConvNet: each conv block (BatchNorm inside a unit)."""
    return name.startswith("blocks.") and name.count(".") == 1


MODELS = {
    "cnn": (convnet, lambda n: um.image_batches(n, WORLD * 4, torch.float32), CNN_UNITS),
    "mlp": (bn_mlp, lambda n: vector_batches(n, WORLD * 4), None),
}
OPTIMIZERS = {
    "adamw": (lambda: fzero.adamw(lr=1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True)),
    "sgd": (lambda: fzero.sgd(lr=0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
}


def _kept(model: torch.nn.Module) -> set[str]:
    return {f"{m}.{n}" for m, mod in model.named_modules() if isinstance(mod, BN)
            for n, _ in mod.named_parameters(recurse=False)}


def oracle(model: torch.nn.Module, make_opt, data, world: int = WORLD, round_kept: bool = False):
    """Plain torch, one replica per rank: before each forward every replica takes the float32
    masters (BatchNorm parameters as they are, the others cast to bf16) and rank 0's buffers
    (DDP's broadcast_buffers); the input is cast to bf16, the logits upcast for the loss; the
    float32 gradients are summed over ranks and divided by ``world``; torch.optim steps the
    float32 masters. ``round_kept``: BatchNorm's parameters rounded through bf16 (what computing
    them in bf16 would do), to show the tolerance tells that apart. Returns (masters, each
    replica, mean losses)."""
    main = copy.deepcopy(model)
    opt = make_opt(main.parameters())
    kept = _kept(model)
    replicas = [copy.deepcopy(model) for _ in range(world)]
    for rep in replicas:
        for n, p in rep.named_parameters():
            if n not in kept:
                p.data = p.data.to(BF16)
    losses = []
    for batch in data:
        parts = um.split_rows(batch, world)
        rank0 = {n: b.clone() for n, b in replicas[0].named_buffers()}
        masters = dict(main.named_parameters())
        grads, total = {}, 0.0
        for r, rep in enumerate(replicas):
            with torch.no_grad():
                for n, p in rep.named_parameters():
                    # a cast to bf16 outside BatchNorm
                    p.copy_(masters[n].to(BF16) if round_kept and n in kept else masters[n])
                for n, b in rep.named_buffers():
                    b.copy_(rank0[n])
            rep.zero_grad(set_to_none=True)
            x, y = parts[r]
            loss = F.cross_entropy(rep(x.to(BF16)).float(), y)
            loss.backward()
            total += loss.item()
            for n, p in rep.named_parameters():
                g = p.grad.float()
                grads[n] = g if n not in grads else grads[n] + g
        for n, p in main.named_parameters():
            p.grad = grads[n] / world
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / world)
    return main, replicas, losses


def run(model, optimizer, data, *, stage, units=None, compile=False, comm=None, **precision):
    comm = comm or fzero.SimulatedWorld(WORLD)
    state = fzero.init_train_state(model, optimizer, comm, stage=stage, units=units,
                                   precision=fzero.MixedPrecision(param_dtype=BF16, **precision))
    step = fzero.make_train_step(fzero.module_loss(model, F.cross_entropy), comm, compile=compile)
    state, losses = run_steps(step, state, comm, data)
    return state, comm, losses


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return max_rel_err(a.double(), b.double())


def assert_matches_oracle(state, comm, ref, replicas, tol):
    full = fzero.full_params(state.shard, comm)  # the float32 masters
    for name, p in ref.named_parameters():
        for r in range(comm.local_ranks):
            assert full[name].dtype == torch.float32
            err = rel_err(full[name][r], p.detach())
            assert err <= tol, f"{name} rank {r}: relative error {err:.3g} > {tol}"
    for i, name in enumerate(state.module.buffers):
        for r, rep in enumerate(replicas):
            want = dict(rep.named_buffers())[name]
            got = state.buffers[i][r]
            assert got.dtype == want.dtype, name
            assert rel_err(got, want) <= tol if want.is_floating_point() else torch.equal(got, want), name


# The tolerances. fzero's step runs each rank's forward and backward with the same kernels on
# the same dtypes and shapes as the oracle's replica and sums the two ranks' float32 gradients
# (a + b: one rounding, either order), then divides by 2 as the oracle does: BatchNorm's
# running statistics come out bit for bit equal (checked at 1e-6 like the parameters, found
# equal). What is left is the update rule's float32 rounding: fzero's SGD and AdamW against
# torch.optim's (fused AdamW) order their operations differently, a few ulps per step (at most
# 1.2e-7 relative measured after 4 steps, every case here). A BatchNorm parameter computed in
# bf16 would be off by up to one bf16 rounding, 2^-9 = 2e-3, relative
# (test_the_tolerance_tells_bf16_batchnorm_apart): 1e-6 tells the two apart by three orders
# of magnitude. Losses: fzero averages the ranks' losses in float32, the oracle in Python
# floats (4e-8 relative measured).
TOL = 1e-6
LOSS_TOL = 1e-6

CASES = [  # (model, optimizer, stage)
    ("cnn", "adamw", 1), ("cnn", "sgd", 2), ("cnn", "adamw", 3),
    ("mlp", "sgd", 1), ("mlp", "adamw", 2), ("mlp", "sgd", 3),
]


def _units(kind: str, stage: int):
    return (MODELS[kind][2] or (torch.nn.Linear,)) if stage == 3 else None


@pytest.mark.parametrize("kind,opt,stage", CASES, ids=[f"{k}-{o}-stage{s}" for k, o, s in CASES])
def test_bf16_batchnorm_matches_oracle(kind, opt, stage):
    build, make_data, _ = MODELS[kind]
    model = build()
    data = make_data(STEPS)
    make_fz, make_torch = OPTIMIZERS[opt]
    ref, replicas, ref_losses = oracle(model, make_torch, data)
    state, comm, losses = run(model, make_fz(), data, stage=stage, units=_units(kind, stage))
    assert_matches_oracle(state, comm, ref, replicas, TOL)
    assert losses == pytest.approx(ref_losses, rel=LOSS_TOL)
    # the gathered parameters: BatchNorm's float32, the rest bf16 (stages 1-2 keep them)
    kept = _kept(model)
    for g in state.layout.groups:
        assert g.keep_dtype == all(state.layout.slots[i].path in kept for i in g.slots)
    for g, flat in zip(state.layout.groups, state.params):
        assert flat.dtype == (torch.float32 if g.keep_dtype else BF16)


# Compiled against eager (which the oracle checks). Inductor fuses the elementwise work around
# each convolution and matmul and keeps a fused kernel's bf16 intermediates in float32, rounding
# only what it stores, where eager rounds every op's bf16 output: the two differ by bf16
# roundings, which BatchNorm's backward amplifies (measured after 2 SGD steps of lr 1e-3: first
# losses equal for the CNN, 6e-4 apart for the MLP). Not an oracle to 1e-6 then, but: the step
# compiles and runs (fullgraph) with BatchNorm's float32 weights on bf16 inputs inside the graph
# (the Checked BatchNorms raise otherwise, at trace time), and follows eager within bf16
# roundings. A gentle SGD keeps the comparison meaningful: this MLP's first BatchNorm bias has
# a zero gradient in exact arithmetic (the next BatchNorm removes it), so its value, and any
# relative error of it, is rounding noise: compared with an absolute floor.
# few: compiling is slow; inductor's bf16 kernels on the MLP at stage 3, the CNN at stage 2 through
# helpers.CHEAP_COMPILE (its BatchNorms' float32 weights on bf16 inputs in one graph; inductor in the long profile)
COMPILED = [("cnn", 2, CHEAP_COMPILE), ("mlp", 3, True)]


@pytest.mark.parametrize("kind,stage,how", COMPILED, ids=[f"{k}-stage{s}" for k, s, _ in COMPILED])
def test_compiled_follows_eager(kind, stage, how):
    build, make_data, _ = MODELS[kind]
    data = make_data(2)
    eager, comm, le = run(build(), fzero.sgd(lr=1e-3), data, stage=stage, units=_units(kind, stage))
    compiled, _, lc = run(build(), fzero.sgd(lr=1e-3), data, stage=stage, units=_units(kind, stage), compile=how)
    assert lc == pytest.approx(le, rel=5e-3)
    e, c = fzero.full_params(eager.shard, comm), fzero.full_params(compiled.shard, comm)
    for k in e:
        torch.testing.assert_close(c[k], e[k], rtol=1e-3, atol=1e-5, msg=k)
    for g, flat in zip(compiled.layout.groups, compiled.params):
        assert flat.dtype == (torch.float32 if g.keep_dtype else BF16)


def test_the_tolerance_tells_bf16_batchnorm_apart():
    """The oracle with BatchNorm's parameters rounded through bf16 is far outside TOL."""
    build, make_data, _ = MODELS["cnn"]
    data = make_data(STEPS)
    make_torch = OPTIMIZERS["adamw"][1]
    ref, _, _ = oracle(build(), make_torch, data)
    rounded, _, _ = oracle(build(), make_torch, data, round_kept=True)
    worst = max(rel_err(p, q) for p, q in zip(rounded.parameters(), ref.parameters()))
    assert worst > 100 * TOL


def test_reduce_dtype_bf16_reduces_kept_gradients_in_bf16_too():
    """reduce_dtype applies to every gradient, kept ones included: the run equals the oracle
    whose float32 gradient average is rounded through bf16 (one bf16 rounding of the sum and
    of the quotient); stage 2 against stage 3, bitwise."""
    model = convnet()
    data = MODELS["cnn"][1](2)
    s2, comm, l2 = run(model, fzero.sgd(lr=0.1), data, stage=2, reduce_dtype=BF16)
    s3, _, l3 = run(model, fzero.sgd(lr=0.1), data, stage=3, units=CNN_UNITS, reduce_dtype=BF16)
    assert l2 == l3
    p2, p3 = fzero.full_params(s2.shard, comm), fzero.full_params(s3.shard, comm)
    for k in p2:
        assert torch.equal(p2[k], p3[k]), k


def test_keep_dtype_empty_names_the_batchnorm():
    model = convnet()
    with pytest.raises(ValueError, match=r"blocks\.0\.1 is a CheckedBatchNorm2d .*keep_dtype"):
        fzero.init_train_state(model, fzero.sgd(lr=0.1), fzero.SimulatedWorld(WORLD),
                               precision=fzero.MixedPrecision(param_dtype=BF16, keep_dtype=()))
    # what the check saves the user from: torch's own error at the first forward
    bn = torch.nn.BatchNorm2d(3)
    bn.weight.data, bn.bias.data = bn.weight.data.to(BF16), bn.bias.data.to(BF16)
    with pytest.raises(RuntimeError, match="expected scalar type"):
        bn(torch.randn(2, 3, 4, 4, dtype=BF16))


def test_keep_dtype_empty_is_fine_without_a_conflict():
    """keep_dtype=() with BatchNorms whose statistics are in param_dtype (a model the user
    converted) or that have none (track_running_stats=False): every parameter computes in bf16."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8, track_running_stats=False),
                                torch.nn.Linear(8, 5))
    state, _, losses = run(model, fzero.sgd(lr=0.1), vector_batches(2, WORLD * 4), stage=2, keep_dtype=())
    assert all(not g.keep_dtype for g in state.layout.groups) and len(state.layout.groups) == 1
    assert state.params[0].dtype == BF16 and all(l == l for l in losses)


def test_keep_dtype_is_checked():
    with pytest.raises(TypeError, match="is not an nn.Module class"):
        fzero.MixedPrecision(param_dtype=BF16, keep_dtype=(BN, "BatchNorm2d"))
    with pytest.raises(TypeError, match=r"keep_dtype=\(cls,\)"):
        fzero.MixedPrecision(param_dtype=BF16, keep_dtype=torch.nn.LayerNorm)
    p = fzero.MixedPrecision(param_dtype=BF16, keep_dtype=[torch.nn.LayerNorm])
    assert p.keep_dtype == (torch.nn.LayerNorm,) and hash(p) == hash(p)


def test_keep_dtype_other_classes_and_float32_unchanged():
    """A LayerNorm kept on request (it needs nothing: torch's layer_norm takes bf16 input with
    float32 weights); without a param_dtype nothing is kept and the layout is the policy-free one."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 5))
    state, _, _ = run(model, fzero.sgd(lr=0.1), vector_batches(2, WORLD * 4), stage=1,
                      keep_dtype=(torch.nn.LayerNorm,))
    kept = [state.layout.slots[i].path for g in state.layout.groups if g.keep_dtype for i in g.slots]
    assert kept == ["1.weight", "1.bias"]
    comm = fzero.SimulatedWorld(WORLD)
    plain = fzero.init_train_state(convnet(), fzero.sgd(lr=0.1), comm)
    default = fzero.init_train_state(convnet(), fzero.sgd(lr=0.1), comm,
                                     precision=fzero.MixedPrecision(reduce_dtype=BF16))
    assert plain.layout == default.layout and not any(s.keep_dtype for s in plain.layout.slots)


def test_layout_keeps_and_fingerprints_the_kept_parameters():
    comm = fzero.SimulatedWorld(WORLD)
    kept = fzero.init_train_state(convnet(), fzero.sgd(lr=0.1), comm,
                                  precision=fzero.MixedPrecision(param_dtype=BF16)).layout
    plain = fzero.init_train_state(convnet(), fzero.sgd(lr=0.1), comm).layout
    assert kept != plain
    # ranks that disagree (one without the policy) are told which parameter and why
    assert kept.first_difference(plain) == "parameter 'blocks.0.1.weight': keep_dtype True vs False"
    slot = next(s for s in kept.slots if s.path == "blocks.0.1.weight")
    assert slot.keep_dtype and compute_dtype(slot, BF16) == torch.float32
    conv = next(s for s in kept.slots if s.path == "blocks.0.0.weight")
    assert not conv.keep_dtype and compute_dtype(conv, BF16) == BF16
    assert kept.with_world_size(3).slots[slot_index(kept, "blocks.0.1.weight")].keep_dtype


def slot_index(layout, path):
    return next(i for i, s in enumerate(layout.slots) if s.path == path)


def test_frozen_batchnorm_stays_float32():
    model = convnet()
    model.blocks[0][1].requires_grad_(False)
    state, _, losses = run(model, fzero.sgd(lr=0.1), MODELS["cnn"][1](2), stage=2)
    i = [s.path for s in state.layout.frozen_slots].index("blocks.0.1.weight")
    assert state.shard.frozen[i].dtype == torch.float32 and all(l == l for l in losses)
    state3, _, _ = run(model, fzero.sgd(lr=0.1), MODELS["cnn"][1](2), stage=3, units=CNN_UNITS)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_report_predicts_two_compute_dtypes(stage):
    """memory_report against the state and a census of one eager step: the kept groups'
    gathered parameters and gradient buckets are float32, the others bf16 (the step's buffers
    at their joint peak against the census on larger models: tests/test_memory_census.py)."""
    comm = fzero.SimulatedWorld(WORLD)
    model = convnet()
    precision = fzero.MixedPrecision(param_dtype=BF16)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage, precision=precision,
                                   units=CNN_UNITS if stage == 3 else None)
    step = fzero.make_train_step(fzero.module_loss(model, F.cross_entropy), comm)
    batch = comm.split_batch(MODELS["cnn"][1](1)[0])
    state, _ = step(state, batch)  # warm-up: lazily built pieces
    rep = fzero.memory_report(state.layout, state.opt.optimizer, stage=stage, precision=precision, comm=comm)
    params = sum(g.padded_numel * (4 if g.keep_dtype else 2) for g in state.layout.groups)
    assert rep.by_kind["params"] == (params if stage < 3 else params / WORLD)
    if stage < 3:
        assert rep.held["params"] * comm.local_ranks == sum(p.numel() * p.element_size() for p in state.params)
    with Census() as census:
        state, _ = step(state, batch)
    R, got = comm.local_ranks, census.scope_peaks
    if stage < 3:
        assert got[GRAD_BUCKETS] == rep.step_buffers[GRAD_BUCKETS] * R
    else:  # the root and two units gathered at once, in their two compute dtypes
        assert got[GATHER] == pytest.approx(rep.step_buffers[GATHER] * R, rel=0.1)


def test_checkpoint_round_trip(tmp_path):
    model = convnet()
    data = MODELS["cnn"][1](3)
    state, comm, _ = run(model, fzero.adamw(lr=1e-2), data[:2], stage=2)
    path = fzero.save_checkpoint(state, tmp_path, comm)
    template = fzero.init_train_state(convnet(), fzero.adamw(lr=1e-2), comm,
                                      precision=fzero.MixedPrecision(param_dtype=BF16))
    loaded, _ = fzero.load_checkpoint(path, template, comm)
    for a, b in zip(state.shard.master, loaded.shard.master):
        assert torch.equal(a, b)
    for a, b in zip(state.params, loaded.params):
        assert a.dtype == b.dtype and torch.equal(a, b)
    step = fzero.make_train_step(fzero.module_loss(model, F.cross_entropy), comm)
    s1, m1 = step(state, comm.split_batch(data[2]))
    s2, m2 = step(loaded, comm.split_batch(data[2]))
    assert torch.equal(m1["loss"], m2["loss"])
    for a, b in zip(s1.shard.master, s2.shard.master):
        assert torch.equal(a, b)


GLOO_CASES = ["stage2", "stage3"]


@pytest.mark.distributed
def test_gloo_w2_equals_simulated_world_bitwise():
    """The bf16 BatchNorm CNN on two gloo ranks (stages 2 and 3, eager, 3 steps; compiled steps
    on gloo are bitwise the simulated world's in tests/test_distributed.py, and compiling is slow):
    every rank's masters, gathered parameters (float32 and bf16 groups), BatchNorm statistics
    and losses equal the simulated world's bit for bit."""
    from dist_harness import run_torchrun
    from test_distributed import _case

    results = run_torchrun(2, "bf16_bn_worker.py", GLOO_CASES, timeout=420)
    for name in GLOO_CASES:
        ranks = _case(results, name)
        sim = ranks[0]["sim"]
        for r, res in enumerate(ranks):
            gloo = res["gloo"]
            assert gloo["losses"] == sim["losses"], (name, r)
            for kind in ("masters", "params", "buffers"):
                assert len(gloo[kind]) == len(sim[kind])
                for i, (mine, theirs) in enumerate(zip(gloo[kind], sim[kind])):
                    assert mine.dtype == theirs.dtype and torch.equal(mine[0], theirs[r]), (name, r, kind, i)
        assert name == "stage3" or {p.dtype for p in sim["params"]} == {torch.float32, BF16}


def test_meta_init_keeps_batchnorm_too():
    """A model built on the meta device and materialised by init_train_state(init=...) gets
    the same layout (kept groups included) and masters as the eager one."""
    with torch.device("meta"):
        meta = ConvNet()
    comm = fzero.SimulatedWorld(WORLD)
    precision = fzero.MixedPrecision(param_dtype=BF16)
    torch.manual_seed(0)
    made = fzero.init_train_state(meta, fzero.sgd(lr=0.1), comm, precision=precision, init="reset_parameters")
    torch.manual_seed(0)
    eager = fzero.init_train_state(ConvNet(), fzero.sgd(lr=0.1), comm, precision=precision)
    assert made.layout == eager.layout and any(g.keep_dtype for g in made.layout.groups)
    for a, b in zip(made.shard.master, eager.shard.master):
        assert torch.equal(a, b)
    for a, b in zip(made.params, eager.params):
        assert a.dtype == b.dtype and torch.equal(a, b)
