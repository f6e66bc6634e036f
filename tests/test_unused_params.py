"""Parameters without a gradient (DDP's "unused parameters"): not updated by default, as DDP
with ``find_unused_parameters=True`` and torch.optim; ``unused="zeros"`` keeps the flat
behaviour. Against a one-process oracle of DDP's semantics here (float64, 1e-12); against DDP
itself on gloo, and simulated == gloo bitwise, in ``test_distributed.py``."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import fzero
import unused_cases as uc
from helpers import CHEAP_COMPILE

SIM_THREADS_RESTORE = torch.get_num_threads()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _assert_matches(got: dict, want: dict, tol: float = 1e-12) -> None:
    for k, v in want.items():
        err = _rel(got[k], v)
        assert err <= tol, f"{k}: relative error {err:.3g} > {tol}"


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unused_parameters_follow_ddp(stage, opt):
    want = uc.run_oracle(2, opt)
    got = uc.run_fzero(fzero.SimulatedWorld(2), opt, stage)
    _assert_matches(got["params"], want)
    # aux never ran: untouched (no decay); branch sat out step 2: its own count is one behind
    init = dict(uc.Gated().named_parameters())
    assert torch.equal(got["params"]["aux.weight"], init["aux.weight"].detach())
    assert got["steps"] == {"a.weight": 5, "a.bias": 5, "branch.weight": 4, "branch.bias": 4,
                            "aux.weight": 0, "aux.bias": 0, "b.weight": 5, "b.bias": 5}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulation_counts_a_parameter_used_in_any_micro_batch(stage):
    """K = 2 micro-batches on 2 ranks: the average over the 4 (rank, micro-batch) parts, as DDP's
    semantics on 4 ranks; a parameter is used if any rank used it in any micro-batch."""
    want = uc.run_oracle(4, "adamw")
    got = uc.run_fzero(fzero.SimulatedWorld(2), "adamw", stage, accum=2)
    _assert_matches(got["params"], want)
    assert got["steps"]["branch.weight"] == 4 and got["steps"]["aux.weight"] == 0


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_zeros_option_keeps_the_flat_behaviour(opt):
    """``unused="zeros"``: every parameter takes every step, as DeepSpeed's flat buffers."""
    want = uc.run_oracle(2, opt)
    got = uc.run_fzero(fzero.SimulatedWorld(2), opt, 2, unused="zeros")
    assert _rel(got["params"]["aux.bias"], want["aux.bias"]) > 1e-3  # decay/momentum moved it
    assert set(got["steps"].values()) == {5}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_compiled_unused_parameters_without_recompiles(stage):
    want = uc.run_oracle(2, "adamw", branch=True)
    counters.clear()
    # CHEAP_COMPILE (dynamo's guards and graph): inductor's masked update of a flat group runs on gloo's ranks at
    # stage 2 (dist_worker.case_unused, test_gloo_compiled_unused_parameters_equal_ddp)
    got = uc.run_fzero(fzero.SimulatedWorld(2), "adamw", stage, compile=CHEAP_COMPILE, branch=True)
    _assert_matches(got["params"], want)
    assert got["steps"]["aux.weight"] == 0 and got["steps"]["a.weight"] == uc.STEPS
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"], dict(counters["recompiles"])


def test_checkpoints_and_torch_optim_interchange_keep_each_parameters_count(tmp_path):
    """``OptState.missed`` is saved and loaded; torch.optim's state dict has each parameter's
    own ``step`` and no state for a parameter that never stepped, as torch's own; imported
    back, the counts are the same."""
    from fzero.checkpoint import (
        export_torch_optim_state_dict,
        import_torch_optim_state_dict,
        load_checkpoint,
        save_checkpoint,
    )
    from fzero.checkpoint.offline import consolidate_torch_optim_state_dict

    comm = fzero.SimulatedWorld(2)
    model = uc.Gated()
    make = uc.OPTIMIZERS["adamw"][0]
    state = fzero.init_train_state(model, make(), comm, alignment=4)
    step = fzero.make_train_step(fzero.module_loss(model, uc.mse), comm)
    for b in uc.batches(2):
        state, _ = step(state, comm.split_batch(b))
    assert state.opt.missed[0].tolist() == [0, 0, 1, 1, 5, 5, 0, 0]
    path = save_checkpoint(state, tmp_path, comm)
    template = fzero.init_train_state(uc.Gated(), make(), comm, alignment=4)
    loaded, _ = load_checkpoint(path, template, comm)
    assert torch.equal(loaded.opt.missed[0], state.opt.missed[0])
    # torch's own optimizer after the oracle's run: per-parameter steps, none for aux
    ref = uc.Gated()
    torch_opt = uc.OPTIMIZERS["adamw"][1](ref.parameters())
    for x, y in uc.batches(2):  # the oracle's run to get its optimizer state
        grads = {}
        for xr, yr in zip(x.chunk(2), y.chunk(2)):
            ref.zero_grad(set_to_none=True)
            uc.mse(ref(xr), yr).backward()
            for n, q in ref.named_parameters():
                if q.grad is not None:
                    grads[n] = grads.get(n, 0) + q.grad
        for n, q in ref.named_parameters():
            q.grad = grads[n] / 2 if n in grads else None
        torch_opt.step()
    torch_steps = {k: float(v["step"]) for k, v in torch_opt.state_dict()["state"].items()}
    for exported in (export_torch_optim_state_dict(state, comm), consolidate_torch_optim_state_dict(path)):
        assert {k: float(v["step"]) for k, v in exported["state"].items()} == torch_steps
    assert torch_steps == {0: 5.0, 1: 5.0, 2: 4.0, 3: 4.0, 6: 5.0, 7: 5.0}
    back = import_torch_optim_state_dict(template, {k: v.detach() for k, v in ref.named_parameters()},
                                         torch_opt.state_dict(), comm)
    assert back.opt.missed[0].tolist() == [0, 0, 1, 1, 5, 5, 0, 0] and int(back.opt.step) == 5


def test_unused_option_is_checked():
    with pytest.raises(ValueError, match=r"unused must be one of \('skip', 'zeros'\), got 'drop'"):
        fzero.make_train_step(lambda p, b: 0, fzero.SimulatedWorld(1), unused="drop")


@pytest.fixture(scope="module")
def gloo():
    from dist_harness import run_torchrun

    return run_torchrun(2, "dist_worker.py", ["unused"], timeout=400)


def _gloo_case(results):
    for r, res in enumerate(results):
        if "exception" in res["unused"]:
            pytest.fail(f"rank {r} raised:\n{res['unused']['exception']}")
    return [res["unused"] for res in results]


@pytest.mark.distributed
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gloo_unused_parameters_equal_ddp(gloo, stage, opt):
    """DDP(find_unused_parameters=True) + torch.optim on 2 gloo ranks, float64: a branch one rank
    takes, a step no rank takes it, a head no rank ever uses. fzero on the same ranks is within
    1e-12 of DDP, and bitwise the simulated world's rank."""
    torch.set_num_threads(1)  # the workers' thread count: the simulated world's bits need it
    try:
        sim = uc.run_fzero(fzero.SimulatedWorld(2), opt, stage)
    finally:
        torch.set_num_threads(SIM_THREADS_RESTORE)
    for r, res in enumerate(_gloo_case(gloo)):
        ddp, mine = res[f"ddp_{opt}"], res[f"s{stage}_{opt}"]
        _assert_matches(mine["params"], ddp)
        assert mine["steps"] == sim["steps"]
        for k, v in mine["params"].items():
            assert torch.equal(v, sim["rows"][k][r]), (r, k)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gloo_compiled_unused_parameters_equal_ddp(gloo, stage):
    """Compiled on real ranks (stage 3 there regathers per unit and counts use per unit): the
    unused head stays as it was, as under DDP."""
    for res in _gloo_case(gloo):
        mine = res[f"s{stage}c_adamw"]
        _assert_matches(mine["params"], res["ddp_static_adamw"])
        assert mine["steps"]["aux.weight"] == 0 and mine["steps"]["a.weight"] == uc.STEPS


class _Switch(torch.nn.Module):
    """``b`` runs only while ``use_b`` (a Python flag, so a compiled step traces either way)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.b = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h + torch.tanh(self.b(h)) if self.use_b else h


def _switch_run(compile_from: int, steps: int = 5) -> dict[str, torch.Tensor]:
    """``b`` sits out steps 1-2, then runs; steps from ``compile_from`` on are compiled."""
    comm = fzero.SimulatedWorld(1)
    model = _Switch()
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2, weight_decay=0.1), comm)
    loss = fzero.module_loss(model, torch.nn.functional.mse_loss)
    eager = fzero.make_train_step(loss, comm)
    compiled = fzero.make_train_step(loss, comm, compile=CHEAP_COMPILE)  # the subject: dynamo's guard
    g = torch.Generator().manual_seed(3)
    for i in range(1, steps + 1):
        model.use_b = i > 2
        batch = comm.split_batch((torch.randn(4, 4, generator=g, dtype=torch.float64),
                                  torch.randn(4, 4, generator=g, dtype=torch.float64)))
        state, _ = (compiled if i >= compile_from else eager)(state, batch)
    return {k: v[0] for k, v in fzero.full_params(state.shard, comm).items()}


def test_compiled_steps_after_a_parameter_sat_out_use_its_own_step_count():
    """A compiled step whose every parameter has a gradient compiles the plain update only
    while no parameter ever sat out a step (read on the host before the call): after ``b``
    sat out two eager steps, the compiled steps still give it its own bias correction."""
    want = _switch_run(compile_from=99)
    _assert_matches(_switch_run(compile_from=3), want)
    _assert_matches(_switch_run(compile_from=1), want)
