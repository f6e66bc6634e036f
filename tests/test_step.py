"""The composed step: compiled vs eager, skipped steps, loss scaling and mixed precision."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import fzero
from helpers import CHEAP_COMPILE, batches, max_rel_err, mlp

mse = torch.nn.functional.mse_loss


def _setup(world=2, dtype=torch.float32, scaler=None, stage=2, optimizer=None, precision=fzero.MixedPrecision()):
    model = mlp(dtype)
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(
        model, optimizer or fzero.adamw(lr=1e-2), comm, scaler=scaler, precision=precision, stage=stage
    )
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    return model, comm, state, step


def _poison(batch, rank, world):
    x, y = batch
    x = x.clone()
    x[rank * (x.shape[0] // world), 0] = float("inf")
    return x, y


@pytest.mark.parametrize("stage", [1, 2])
def test_compiled_equals_eager_without_recompiles(stage):
    world = 2
    scaler = fzero.init_scaler(2.0**8, growth_interval=2)
    model, comm, state, step = _setup(world, scaler=scaler, stage=stage)
    torch._dynamo.reset()
    counters.clear()
    compiled = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=True)
    eager_state = state
    scales, skipped = [], []
    for i, batch in enumerate(batches(10, world, 3, torch.float32)):
        if i == 5:
            batch = _poison(batch, 1, world)
        b = comm.split_batch(batch)
        state, m = compiled(state, b)
        eager_state, me = step(eager_state, b)
        scales.append(m["scale"].item())
        skipped.append(m["found_inf"].item())
        for k in m:
            assert torch.allclose(m[k], me[k], rtol=1e-6, atol=0, equal_nan=True), k
        for a, b_ in zip(state.shard.master, eager_state.shard.master):
            assert max_rel_err(a, b_) <= 1e-6
    assert skipped == [0.0] * 5 + [1.0] + [0.0] * 4
    assert len(set(scales)) >= 3, scales  # the scale grew and backed off
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compile_passes_torch_compile_arguments_on():
    """``compile={"backend": ...}`` reaches ``torch.compile``: a backend of our own sees the one
    graph, and the step runs it: the eager step's numbers within a few fp32 roundings (the
    graph runs torch's own kernels, but not all the ones the eager step calls)."""
    model, comm, state, eager = _setup(2, stage=2)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile={"backend": backend})
    got, want = state, state
    for batch in batches(3, 2, 3, torch.float32):
        got, m = compiled(got, comm.split_batch(batch))
        want, me = eager(want, comm.split_batch(batch))
        torch.testing.assert_close(m["loss"], me["loss"], rtol=5e-7, atol=0)  # measured 1.5e-7
    assert len(graphs) == 1
    for a, b in zip(got.shard.master, want.shard.master):
        assert max_rel_err(a, b) <= 1e-7  # measured 2.9e-8


@pytest.mark.parametrize("optimizer", [fzero.adamw(lr=1e-2), fzero.sgd(lr=0.1, momentum=0.9)], ids=["adamw", "sgd"])
def test_a_compiled_step_is_traced_once(optimizer):
    """Dynamo gives a 0-d float64 CPU input (a hyperparameter) a symbolic float and, seeing it used only as a tensor,
    restarts its analysis and traces the whole step again (GPT-2 at stage 2: 19 s of compile, 9 of them the second
    trace); the compiled call hands the hyperparameters in as ``[1]`` views, so one trace, and a new value is no
    recompile."""
    from torch._dynamo.utils import compilation_time_metrics, compile_times

    comm = fzero.SimulatedWorld(2)
    model = mlp()
    state = fzero.init_train_state(model, optimizer, comm)
    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()  # the process's, from every compile before
    compiled = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=CHEAP_COMPILE)
    for i, batch in enumerate(batches(3, 2, 2, torch.float32)):
        state = state.replace(opt=fzero.optim.set_hyperparams(state.opt, lr=0.01 * (i + 1)))
        state, _ = compiled(state, comm.split_batch(batch))
        assert state.opt.hyper[0]["lr"].shape == () and state.opt.hyper[0]["lr"].item() == 0.01 * (i + 1)
    attempts = [line.split(",")[0] for line in compile_times(repr="str").splitlines() if "compile_attempt" in line]
    assert attempts == ["compile_attempt_0"], attempts
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], dict(counters["recompiles"])


@pytest.mark.parametrize("compile,error,named", [
    ({"fullgraph": False}, ValueError, "fullgraph"),
    ({"dynamic": True, "mode": "default"}, ValueError, "dynamic"),
    ({"backnd": "aot_eager"}, ValueError, "backnd"),
    ("inductor", TypeError, "str"),
])
def test_compile_arguments_fzero_owns_or_does_not_know_are_named(compile, error, named):
    model, comm, state, _ = _setup(1)
    with pytest.raises(error, match=named):
        fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=compile)


@pytest.mark.parametrize("stage", [1, 2])
def test_inf_on_one_rank_skips_everywhere(stage):
    world = 3
    _, comm, state, step = _setup(world, scaler=fzero.init_scaler(2.0**10), stage=stage)
    data = batches(3, world, 2, torch.float32)
    state, _ = step(state, comm.split_batch(data[0]))  # moments are non-zero now
    before = state
    after, m = step(state, comm.split_batch(_poison(data[1], 1, world)))
    assert m["found_inf"].item() == 1.0
    for a, b in zip(after.shard.master, before.shard.master):
        assert torch.equal(a, b)
    for ma, mb in zip(after.opt.moments, before.opt.moments):
        for a, b in zip(ma, mb):
            assert torch.equal(a, b)
    for a, b in zip(after.params, before.params):
        assert torch.equal(a, b)
    assert torch.equal(after.opt.step, before.opt.step)
    assert after.scaler.scale.item() == 2.0**9 and after.scaler.growth_tracker.item() == 0
    # and training goes on from there
    after2, m2 = step(after, comm.split_batch(data[2]))
    assert m2["found_inf"].item() == 0.0 and int(after2.opt.step) == 2


def test_dynamic_scaling_equals_torch_grad_scaler():
    """fp32 model, dynamic loss scale, infs injected: equals torch.optim.Adam + torch.amp.GradScaler."""
    world, steps = 2, 16
    kw = dict(init_scale=2.0**6, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    model, comm, state, step = _setup(
        world, dtype=torch.float32, scaler=fzero.init_scaler(**kw), optimizer=fzero.adam(lr=1e-2)
    )
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    gs = torch.amp.GradScaler("cpu", **kw)
    bad = {2, 3, 9}
    for i, batch in enumerate(batches(steps, world, 2, torch.float32)):
        if i in bad:
            batch = _poison(batch, i % world, world)
        state, m = step(state, comm.split_batch(batch))
        opt.zero_grad()
        x, y = batch
        loss = sum(mse(ref(a), b) for a, b in zip(x.chunk(world), y.chunk(world))) / world
        gs.scale(loss).backward()
        gs.step(opt)
        gs.update()
        assert m["found_inf"].item() == float(i in bad)
        assert state.scaler.scale.item() == gs.get_scale()
    gathered = fzero.full_params(state.shard, comm)
    for n, p in ref.named_parameters():
        assert max_rel_err(gathered[n][0], p.detach()) <= 1e-5, n


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_equals_reference(param_dtype):
    """16-bit compute, fp32 master and fp32 reduction: equals a hand-written reference loop
    (16-bit copy of the fp32 master, autograd per rank, fp32 mean, torch.optim.AdamW on the master)."""
    world, steps = 2, 8
    scaler = fzero.static_scaler(1.0)
    model, comm, state, step = _setup(
        world, scaler=scaler, precision=fzero.MixedPrecision(param_dtype=param_dtype)
    )
    master = copy.deepcopy(model)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    low = copy.deepcopy(model).to(param_dtype)
    for batch in batches(steps, world, 4, torch.float32):
        state, m = step(state, comm.split_batch(batch))
        x, y = batch
        grads = []
        for a, b in zip(x.chunk(world), y.chunk(world)):
            with torch.no_grad():
                for pl, pm in zip(low.parameters(), master.parameters()):
                    pl.copy_(pm)
            low.zero_grad()
            mse(low(a.to(param_dtype)).float(), b).backward()
            grads.append([p.grad.float() for p in low.parameters()])
        for pm, *gs in zip(master.parameters(), *grads):
            pm.grad = sum(gs) / world
        opt.step()
    assert all(p.dtype == param_dtype for p in state.params)
    assert all(v.dtype == param_dtype for v in fzero.full_params(state.shard, comm, param_dtype).values())
    master_full = fzero.full_params(state.shard, comm, torch.float32)
    for n, p in master.named_parameters():
        assert max_rel_err(master_full[n][0], p.detach()) <= 1e-5, n


def test_fp16_low_precision_reduction_does_not_overflow():
    """fp16 communication of gradients equal to 40000 on each of 2 ranks averages to 40000."""
    comm = fzero.SimulatedWorld(2)
    shard = fzero.init_shard({"w": torch.zeros(8)}, comm, alignment=1)
    grads = {"w": torch.full((2, 8), 40000.0, dtype=torch.float16)}
    (out,) = fzero.reduce_scatter_grads(shard, grads, comm, reduce_dtype=torch.float16)
    assert out.dtype == torch.float32
    assert torch.all(out == 40000.0)
    # Without the pre-divide the fp16 sum would overflow:
    assert torch.isinf(grads["w"][0] + grads["w"][1]).all()


@pytest.mark.parametrize("reduce_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_low_precision_reduction_equals_fsdp_hook_math(reduce_dtype, world):
    """Pre-divide, sum, post-divide in the low dtype, cast to fp32: as FSDP's compress hooks."""
    comm = fzero.SimulatedWorld(world)
    shard = fzero.init_shard({"w": torch.zeros(5, 3)}, comm, alignment=1)
    g = torch.randn(world, 5, 3).to(reduce_dtype)
    shards = fzero.reduce_scatter_grads(shard, {"w": g}, comm, reduce_dtype=reduce_dtype)
    pre, post = fzero.comm.gradient_divide_factors(world)
    assert pre * post == world
    total = g[0] / pre if pre > 1 else g[0]
    for r in range(1, world):
        total = total + (g[r] / pre if pre > 1 else g[r])
    expected = (total / post if post > 1 else total).float().reshape(-1)
    got = torch.cat(list(shards[0]))[:15]
    # Summation order/accumulation may differ from this sequential reference (the simulated
    # world accumulates in fp32 and rounds once): allow W roundings of the summands.
    atol = world * torch.finfo(reduce_dtype).eps * g.float().abs().max().item()
    assert torch.allclose(got, expected, rtol=0, atol=atol)
    assert max_rel_err(got, g.double().mean(0).reshape(-1).float()) < 5e-2


def test_divide_factors_table():
    table = {1: (1, 1), 2: (2, 1), 3: (2, 1.5), 4: (2, 2), 6: (4, 1.5), 8: (4, 2), 16: (4, 4)}
    for w, (pre, post) in table.items():
        assert fzero.comm.gradient_divide_factors(w) == (pre, post)


def test_frozen_module_params_and_clipping():
    """Clipping equals torch.nn.utils.clip_grad_norm_ on the full averaged gradient; frozen stay put."""
    world = 2
    model = mlp(torch.float64)
    model[0].requires_grad_(False)
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, clip_norm=0.05)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for batch in batches(5, world, 2, torch.float64):
        state, m = step(state, comm.split_batch(batch))
        opt.zero_grad()
        x, y = batch
        (sum(mse(ref(a), b) for a, b in zip(x.chunk(world), y.chunk(world))) / world).backward()
        norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.05)
        assert abs(m["grad_norm"].item() - norm.item()) <= 1e-6 * norm.item()
        opt.step()
    gathered = fzero.full_params(state.shard, comm)
    for n, p in ref.named_parameters():
        assert max_rel_err(gathered[n][1], p.detach()) <= 1e-10, n
    assert torch.equal(gathered["0.weight"][0], model[0].weight)
