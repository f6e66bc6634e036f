"""check_replicas / replicas_differ: no false alarms, every one-element difference caught
and named, policies for buffers and generator states, compiled, and on gloo at W = 3."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fzero
from fzero.pytree import replace
from fzero.replicas import Divergence, replica_digest, replica_items
from helpers import CHEAP_COMPILE, batches, children, mlp

mse = torch.nn.functional.mse_loss


def _trained(world=3, stage=2, steps=2, precision=fzero.MixedPrecision(), **kw):
    model = mlp(torch.float32)
    comm = fzero.SimulatedWorld(world)
    units = children if stage == 3 else None
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage, units=units,
                                   precision=precision, alignment=4, **kw)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    for b in batches(steps, world, 2, torch.float32):
        state, _ = step(state, comm.split_batch(b))
    return state, comm


def _with_params(state, group, fn):
    params = list(state.params)
    params[group] = fn(params[group].clone())
    return replace(state, params=tuple(params))


def _flip(x, row, index, bit):
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    flat = x[row].view(ints)
    flat[index] ^= (1 << bit) if bit < 8 * x.element_size() - 1 else -(1 << bit)
    return x


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_false_alarm_after_training(stage):
    state, comm = _trained(stage=stage)
    assert not bool(fzero.replicas.replicas_differ(state, comm))
    fzero.replicas.check_replicas(state, comm)


@pytest.mark.parametrize("dtype,bits", [(torch.float32, 32), (torch.bfloat16, 16), (torch.float64, 64)])
def test_every_single_bit_flip_in_a_gathered_buffer_is_caught(dtype, bits):
    if dtype == torch.float64:
        model = mlp(torch.float64)
        comm = fzero.SimulatedWorld(3)
        state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm, alignment=4)
    else:
        state, comm = _trained(precision=fzero.MixedPrecision(param_dtype=dtype))
    n = state.params[0].shape[1]
    g = torch.Generator().manual_seed(0)
    # every element (padding included) with a random bit, and every bit of a few elements
    cases = [(i, int(torch.randint(bits, (), generator=g))) for i in range(n)]
    cases += [(i, b) for i in (0, n // 2, n - 1) for b in range(bits)]
    for index, bit in cases:
        bad = _with_params(state, 0, lambda p, index=index, bit=bit: _flip(p, 2, index, bit))
        assert bool(fzero.replicas.replicas_differ(bad, comm)), (index, bit)
    with pytest.raises(fzero.ReplicaDivergenceError) as e:
        fzero.replicas.check_replicas(_with_params(state, 0, lambda p: _flip(p, 2, n - 1, 0)), comm)
    (d,) = e.value.differences
    assert (d.agree, d.differ) == ((0, 1), (2,))
    assert "<padding> on rank 2" in d.located[0], d.located  # the last element is padding here


def test_error_names_item_ranks_and_parameter():
    state, comm = _trained(world=3)
    slot = state.layout.slots[2]  # a parameter inside flat group 0
    bad = _with_params(state, slot.group, lambda p: _flip(p, 0, slot.offset + 1, 5))
    with pytest.raises(fzero.ReplicaDivergenceError) as e:
        fzero.replicas.check_replicas(bad, comm)
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert "params flat group 0" in msg and "differs on rank 0 (ranks 1, 2 agree)" in msg, msg
    assert f"{slot.path} on rank 0" in msg, msg
    assert e.value.differences == (Divergence(e.value.differences[0].item, (1, 2), (0,), (f"{slot.path} on rank 0",)),)


def test_two_ranks_without_majority():
    state, comm = _trained(world=2)
    bad = _with_params(state, 0, lambda p: _flip(p, 1, 3, 0))
    with pytest.raises(fzero.ReplicaDivergenceError, match="differs on rank 1 from rank 0"):
        fzero.replicas.check_replicas(bad, comm, locate=False)


def test_each_replicated_scalar_changes_its_own_digest_columns():
    state, comm = _trained(world=2, steps=1)
    names = [n for n, _, _ in replica_items(state)]
    base = replica_digest(state, comm)
    variants = {
        "scaler.scale": replace(state, scaler=replace(state.scaler, scale=torch.nextafter(state.scaler.scale, torch.tensor(9.0)))),
        "scaler.growth_tracker": replace(state, scaler=replace(state.scaler, growth_tracker=state.scaler.growth_tracker + 1)),
        "opt.step": replace(state, opt=replace(state.opt, step=state.opt.step + 1)),
        "opt.hyper[0]['lr']": replace(state, opt=fzero.optim.set_hyperparams(state.opt, lr=0.5)),
        "static": replace(state, scaler=replace(state.scaler, growth_interval=7)),
    }
    for name, s in variants.items():
        d = replica_digest(s, comm)
        changed = {names[j // 2] for j in torch.nonzero((d != base).any(0)).flatten().tolist()}
        assert changed == {name}, (name, changed)


def test_frozen_parameters_are_compared():
    model = mlp(torch.float32)
    model[0].weight.requires_grad_(False)
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm)
    names = [n for n, _, _ in replica_items(state)]
    assert "frozen['0.weight']" in names
    frozen = state.shard.frozen[0].clone()
    frozen[1, 2] += 1
    d0, d1 = replica_digest(state, comm), replica_digest(replace(state, shard=replace(state.shard, frozen=(frozen,))), comm)
    j = names.index("frozen['0.weight']")
    assert not torch.equal(d0[:, 2 * j : 2 * j + 2], d1[:, 2 * j : 2 * j + 2])


def test_buffers_and_rng_policies():
    state, comm = _trained(world=3, steps=0)
    buf = torch.zeros(3, 4)
    buf[1, 3] = 1.0
    rng = torch.arange(3 * 8, dtype=torch.uint8).reshape(3, 8)  # per-rank generator states differ
    state = dataclasses.replace(
        state, buffers=(buf,), rng=(rng,), module=fzero.module.ModuleSpec(buffers=("bn.running_mean",), persistent=(True,))
    )
    with pytest.raises(fzero.ReplicaDivergenceError, match=r"buffers\['bn.running_mean'\] differs on rank 1"):
        fzero.replicas.check_replicas(state, comm, buffers="broadcast")
    fzero.replicas.check_replicas(state, comm)  # buffers are rank-local by default (BatchNorm updates each rank's)
    assert not bool(fzero.replicas.replicas_differ(state, comm, buffers="local"))
    with pytest.raises(fzero.ReplicaDivergenceError, match=r"rng\[0\] differs on ranks 1, 2 \(rank 0"):
        fzero.replicas.check_replicas(state, comm, buffers="local", rng="broadcast")
    with pytest.raises(ValueError, match="buffers must be"):
        fzero.replicas.check_replicas(state, comm, buffers="all")


def test_replicas_differ_compiles_without_graph_breaks():
    from torch._dynamo.utils import counters

    state, comm = _trained(world=2, steps=1)
    bad = _with_params(state, 0, lambda p: _flip(p, 1, 0, 0))
    counters.clear()
    traced = comm.tracing()  # who compiles passes the traced communicator
    f = torch.compile(lambda s: fzero.replicas.replicas_differ(s, traced), fullgraph=True)
    assert not bool(f(state)) and bool(f(bad))
    assert sum(counters["graph_break"].values()) == 0
    assert torch.equal(torch.compile(lambda s: replica_digest(s, traced), fullgraph=True)(bad), replica_digest(bad, comm))


def test_replicas_differ_inside_a_compiled_step_one_graph():
    """The in-step option: the flag of the state a step returns, as a metric, in the step's graph."""
    from torch._dynamo.utils import counters

    model = mlp(torch.float32)
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, alignment=4)
    loss = fzero.module_loss(model, mse)
    core = fzero.step.train_step(loss)

    def step(s, b, comm, workspace):
        new, metrics = core(s, b, comm, workspace)
        return new, {**metrics, "replicas_differ": fzero.replicas.replicas_differ(new, comm).float()}

    counters.clear()
    # torch.compile(fullgraph=True) + autograd flag; inductor: test_in_step_flag_compiles_and_reports_every_step
    compiled = fzero.bind_step(step, loss, comm, compile=CHEAP_COMPILE)
    for b in batches(3, 2, 2, torch.float32):
        state, m = compiled(state, comm.split_batch(b))
        assert m["replicas_differ"].item() == 0.0
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["recompiles"].values()) == 0


@pytest.mark.distributed
def test_gloo_w3_one_element_difference_caught_on_every_rank():
    from dist_harness import run_torchrun

    res = run_torchrun(3, "replica_worker.py", ["corrupt_gather", "scalars", "buffers", "stage3", "grad_and_delay"],
                       timeout=240)
    for r, out in enumerate(res):
        for name, v in out.items():
            assert not (isinstance(v, dict) and "exception" in v), (r, name, v.get("exception"))
        c = out["corrupt_gather"]
        assert c["after_step0"] == {"raised": False, "differ": False}
        bad = c["after_step1"]
        assert bad["raised"] and bad["differ"], bad
        ((item, agree, differ, located),) = bad["items"]
        assert item.startswith("params flat group 0") and agree == (0, 2) and differ == (1,), bad
        assert located == ("0.weight on rank 1",), located
        assert c["records"] == ([(1, 1, "all_gather", 7)] if r == 1 else [])
        s = out["scalars"]
        assert s["clean"] == {"raised": False, "differ": False}
        for case, name, rank in [("scale", "scaler.scale", 0), ("lr", "opt.hyper[0]['lr']", 2), ("step", "opt.step", 1)]:
            assert s[case]["raised"] and s[case]["differ"], (case, s[case])
            assert [(i[0], i[2]) for i in s[case]["items"]] == [(name, (rank,))], (case, s[case]["items"])
            assert f"{name} differs on rank {rank}" in s[case]["message"]
        b = out["buffers"]
        assert b["broadcast"]["items"][0][:3] == ("buffers['bn.running_mean']", (0, 1), (2,))
        assert b["local"] == {"raised": False, "differ": False}
        assert out["stage3"]["clean"] == {"raised": False, "differ": False}
        g = out["grad_and_delay"]  # FaultyWorld on real ranks: only the faulty rank injects
        assert g["found_inf"] == [0.0, 1.0, 0.0] and g["unchanged"] == [False, True, False], g
        assert g["seconds"][2] >= 0.3, g  # every rank waits for the delayed one
        assert g["records"] == {0: [("delay", 2, 0)], 1: [], 2: [("grad", 1, 2)]}[r], g


@pytest.mark.parametrize("mode", ["raise", "flag"])
def test_with_replica_check_every_n_steps(mode):
    from fzero.replicas import with_replica_check
    from fzero.testing import CorruptResult, FaultyWorld

    model = mlp(torch.float32)
    faulty = FaultyWorld(fzero.SimulatedWorld(3), [CorruptResult(step=2, rank=2, op="all_gather", index=1)])
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), faulty, alignment=4)
    inner = faulty.wrap(fzero.make_train_step(fzero.module_loss(model, mse), faulty))
    step = with_replica_check(inner, faulty, every=2, mode=mode)
    data = [faulty.split_batch(b) for b in batches(4, 3, 2, torch.float32)]
    state, m = step(state, data[0])  # call 1: no check
    state, m = step(state, data[1])  # call 2: checked, clean
    if mode == "flag":
        assert m["replicas_differ"].item() == 0.0
    state, m = step(state, data[2])  # call 3, corrupted (scope 2): not a checked call
    if mode == "flag":
        assert m["replicas_differ"].item() == 0.0
    # checking every call catches a corruption in the call where it happens
    step1 = with_replica_check(inner, faulty, every=1, mode=mode)
    faulty.faults = (CorruptResult(step=faulty.step, rank=2, op="all_gather", index=1),)
    if mode == "raise":
        with pytest.raises(fzero.ReplicaDivergenceError, match="differs on rank 2"):
            step1(state, data[3])
    else:
        _, m = step1(state, data[3])
        assert m["replicas_differ"].item() == 1.0
    with pytest.raises(ValueError, match="every"):
        with_replica_check(inner, faulty, every=0)


def test_with_replica_check_rejects_an_unknown_mode():
    """A misspelt mode is an error naming the function, the value and the choices, raised when
    the wrapper is built (not silently treated as one of the modes at the first check)."""
    from fzero.replicas import with_replica_check

    world = fzero.SimulatedWorld(2)

    def never(state, batch):
        raise AssertionError("the step must not run")

    with pytest.raises(ValueError) as info:
        with_replica_check(never, world, mode="bogus")
    assert str(info.value) == "with_replica_check: mode must be 'raise' or 'flag', got 'bogus'"


def test_make_train_step_checks_replicas_every_n_steps():
    """The digest rides on the step's own all-reduce: a corrupted all-gather at the end of
    step 1 is seen by step 2, which raises naming the parameter group and the rank."""
    from fzero.testing import CorruptResult, FaultyWorld

    model = mlp(torch.float32)
    world = FaultyWorld(fzero.SimulatedWorld(3), [CorruptResult(step=1, rank=2, op="all_gather", index=5)])
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), world, alignment=4)
    counting = fzero.comm.CountingCommunicator(world)
    step = world.wrap(fzero.make_train_step(fzero.module_loss(model, mse), counting, check_replicas_every=1))
    data = batches(4, 3, 2, torch.float32)
    state, m0 = step(state, world.split_batch(data[0]))
    assert [r.op for r in counting.records] == ["reduce_scatter", "all_reduce", "all_gather"]  # nothing added
    state, m1 = step(state, world.split_batch(data[1]))  # its all-gather is corrupted on rank 2
    assert m0["replicas_differ"].item() == 0.0 and m1["replicas_differ"].item() == 0.0
    with pytest.raises(fzero.ReplicaDivergenceError, match=r"params flat group 0 .* differs on rank 2"):
        step(state, world.split_batch(data[2]))


def test_in_step_flag_compiles_and_reports_every_step():
    from torch._dynamo.utils import counters

    model = mlp(torch.float32)
    comm = fzero.SimulatedWorld(3)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, alignment=4)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm, check_replicas_every=1,
                                 replica_check="flag", compile=True)
    torch._dynamo.reset()
    counters.clear()
    flags = []
    for i, b in enumerate(batches(3, 3, 2, torch.float32)):
        if i == 2:  # rank 1's gathered parameters drift by one bit
            p = state.params[0].clone()
            p[1, 3] = torch.nextafter(p[1, 3], torch.tensor(2.0))
            state = replace(state, params=(p,))
        state, m = step(state, comm.split_batch(b))
        flags.append(m["replicas_differ"].item())
    assert flags == [0.0, 0.0, 1.0]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


@pytest.mark.parametrize("world", [2, 3, 8])
def test_digest_parts_agree_exactly_iff_every_rank_holds_the_same(world):
    from fzero.replicas import digest_parts, parts_differ

    model = mlp(torch.float32)
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, alignment=4)
    assert not bool(parts_differ(digest_parts(state, comm).sum(0), world))
    p = state.params[0].clone()
    p[world - 1, 0] = torch.nextafter(p[world - 1, 0], torch.tensor(2.0))
    bad = replace(state, params=(p,))
    assert bool(parts_differ(digest_parts(bad, comm).sum(0), world))


def test_static_signature_is_marked_constant_as_torch_marks_it():
    """``fzero.replicas`` marks its static signature for dynamo without importing dynamo
    (``_constant_under_compile``); the mark must be the one ``torch.compiler.assume_constant_result``
    sets, or a compiled replica check would trace into ``hashlib`` (the compiled tests above)."""
    from fzero.replicas import _signature_of

    ours = _signature_of._dynamo_marked_constant
    torchs = torch.compiler.assume_constant_result(lambda: 0)
    assert ours is True and getattr(torchs, "_dynamo_marked_constant", None) is True
