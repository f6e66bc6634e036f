"""Stage 3 with data-dependent units, 0-d parameters, the default wrap policy, a unit whose
output is unused, and the wrap policy's errors.

Ranks that call different units (a branch one rank takes; a list of experts as units) raise
:class:`fzero.units.UnitCallError` on gloo, within seconds, with the text the simulated world raises;
a tiny Mixtral with whole decoder layers (its MoE layers inside) as units trains at stage 3 on
gloo bitwise equal to the simulated world, and in float64 equal to the plain-torch oracle.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dist_cases as cases
import fzero
import user_models as um
from dist_harness import run_torchrun
from test_distributed import _case
from test_user_models import OPTIMIZERS, _data, assert_params_match

transformers = pytest.importorskip("transformers")
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

GLOO_CASES = ["branch", "experts", "last", "experts_agree", "mixtral"]


@pytest.fixture(scope="module")
def w2():
    return run_torchrun(2, "unit_calls_worker.py", GLOO_CASES, timeout=300)


def _sim_error(kind: str) -> str:
    out = cases.divergent_units(fzero.SimulatedWorld(2), kind)
    assert out["type"] == "UnitCallError", out
    return out["error"]


WANT = {
    "branch": "at unit call 2 of the forward: rank 0 called unit 'extra', rank 1 called unit 'b'",
    "experts": "at unit call 2 of the forward: rank 0 called unit 'experts.1', rank 1 called no further "
               "unit (its forward ended)",
    # the last unit's call sends no tag of its own on a real rank (the end's carries it): rank 1
    # sends its end's tag while rank 0 sends its last call's and its end's together
    "last": "at unit call 3 of the forward: rank 0 called unit 'b', rank 1 called no further unit",
}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(WANT))
def test_ranks_calling_different_units_raise_on_gloo_as_in_the_simulated_world(w2, kind):
    sim = _sim_error(kind)
    for r, res in enumerate(_case(w2, kind)):
        assert res["type"] == "UnitCallError", (r, res)
        assert res["error"] == sim, (r, res["error"], sim)
        assert res["seconds"] < 30, (r, res["seconds"])
        assert res["after"] == [2.0], (r, res)  # the process group is still in step


@pytest.mark.parametrize("kind", sorted(WANT))
def test_simulated_world_names_the_units_and_the_ranks(kind):
    error = _sim_error(kind)
    assert WANT[kind] in error
    assert "one unit as a whole" in error


@pytest.mark.distributed
def test_experts_as_units_train_on_gloo_while_the_ranks_agree(w2):
    """Calls out of registration order (a unit gathered on demand after its check, a prefetch
    the end of the forward drops): no false alarm, bitwise the simulated world."""
    ranks = _case(w2, "experts_agree")
    sim = ranks[0]["sim"]
    for r, res in enumerate(ranks):
        assert res["gloo"]["losses"] == sim["losses"], r
        for mine, theirs in zip(res["gloo"]["masters"], sim["masters"]):
            assert torch.equal(mine[0], theirs[r]), r


def test_unit_call_error_carries_the_call_and_the_ranks():
    comm = fzero.SimulatedWorld(2)
    torch.manual_seed(0)
    model = cases.ExpertList()
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm, stage=3, units=cases.DIVERGENT["experts"][1])
    step = fzero.make_train_step(fzero.module_loss(model, F.mse_loss), comm)
    with pytest.raises(fzero.units.UnitCallError) as info:
        step(state, comm.split_batch(cases._divergent_data(2, "experts")))
    assert info.value.call == 2 and info.value.calls == {0: "experts.1", 1: None}


def test_ranks_calling_the_same_units_in_a_data_dependent_model_train():
    """The check compares calls, not models: ranks that all take the branch train as usual."""
    comm = fzero.SimulatedWorld(2)
    torch.manual_seed(0)
    model = cases.BranchUnits()
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm, stage=3, units=cases.DIVERGENT["branch"][1])
    step = fzero.make_train_step(fzero.module_loss(model, F.mse_loss), comm)
    x, y = cases._divergent_data(2, "branch")
    x[4, 0] = 1.0  # rank 1 takes the branch too
    state, m = step(state, comm.split_batch((x, y)))
    assert torch.isfinite(m["loss"])


# --- Mixtral: whole decoder layers (MoE inside) as units ------------------------------------


@pytest.mark.distributed
def test_mixtral_stage3_on_gloo_equals_simulated_world_bitwise(w2):
    ranks = _case(w2, "mixtral")
    sim = ranks[0]["sim"]
    assert sim["units"] == ("model.layers.0", "model.layers.1")
    for r, res in enumerate(ranks):
        assert res["gloo"]["units"] == sim["units"]
        assert res["gloo"]["losses"] == sim["losses"], r
        for g, (mine, theirs) in enumerate(zip(res["gloo"]["masters"], sim["masters"])):
            assert torch.equal(mine[0], theirs[r]), f"rank {r}, flat group {g}"


def test_mixtral_stage3_float64_equals_the_oracle():
    world = 2
    model = um.mixtral().double()
    data = [um.as_labels_batch(b) for b in um.token_batches(3, world * 2, vocab=um.MIXTRAL_VOCAB)]
    make_fz, make_torch = OPTIMIZERS["adamw"]
    ref, _, ref_losses = um.oracle_run(model, make_torch, data, world, um.oracle_loss("labels"))
    comm = fzero.SimulatedWorld(world)
    mine = copy.deepcopy(model)
    state = fzero.init_train_state(mine, make_fz(), comm, stage=3)
    assert state.module.units == ("model.layers.0", "model.layers.1")
    step = fzero.make_train_step(fzero.module_loss(mine), comm)
    losses = []
    for b in data:
        state, m = step(state, comm.split_batch(b))
        losses.append(m["loss"].item())
    assert_params_match(state, comm, ref, 1e-10)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


# --- 0-d parameters ---------------------------------------------------------------------------


class Tempered(torch.nn.Module):
    """A unit with a learnable 0-d temperature, and a weight-normalised Linear."""

    def __init__(self, d: int, dim):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))
        self.wn = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(d, d), dim=dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.wn(self.lin(x)) / self.temperature)


class ScalarModel(torch.nn.Module):
    """Two tempered units, and a 0-d scale in the root."""

    def __init__(self, dim=None):
        super().__init__()
        self.inp = torch.nn.Linear(4, 6)
        self.blocks = torch.nn.ModuleList(Tempered(6, dim) for _ in range(2))
        self.scale = torch.nn.Parameter(torch.tensor(0.7))
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h) * self.scale


@pytest.mark.parametrize("dim", [None, 0], ids=["weight_norm_dim_None", "weight_norm_dim_0"])
def test_zero_d_parameters_in_units_and_root_float64(dim):
    torch.manual_seed(0)
    model = ScalarModel(dim).double()
    zero_d = [n for n, p in model.named_parameters() if p.dim() == 0]
    assert "scale" in zero_d and "blocks.0.temperature" in zero_d
    if dim is None:  # weight_norm(dim=None): its g is 0-d too
        assert "blocks.0.wn.parametrizations.weight.original0" in zero_d
    world = 2
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4 * world, 4, generator=g, dtype=torch.float64),
             torch.randn(4 * world, 3, generator=g, dtype=torch.float64)) for _ in range(3)]
    make_fz, make_torch = OPTIMIZERS["adamw"]
    loss = lambda m, b: F.mse_loss(m(b[0]), b[1])  # noqa: E731
    ref, _, ref_losses = um.oracle_run(model, make_torch, data, world, loss)
    comm = fzero.SimulatedWorld(world)
    mine = copy.deepcopy(model)
    state = fzero.init_train_state(mine, make_fz(), comm, stage=3, units=(Tempered,))
    buckets = {s.path: s.bucket for s in state.layout.slots}
    assert buckets["scale"] == 0 and buckets["blocks.1.temperature"] == 2
    step = fzero.make_train_step(fzero.module_loss(mine, F.mse_loss), comm)
    losses = []
    for b in data:
        state, m = step(state, comm.split_batch(b))
        losses.append(m["loss"].item())
    assert_params_match(state, comm, ref, 1e-10)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


# --- the default wrap policy ----------------------------------------------------------------


@pytest.mark.parametrize("name,build,block", [("gpt2", um.gpt2, GPT2Block), ("llama", um.llama, LlamaDecoderLayer)])
def test_default_units_are_the_blocks_a_transformers_model_names(name, build, block):
    comm = fzero.SimulatedWorld(2)
    data = _data("lm", 2, torch.float32, n=3)
    out = {}
    for units in (None, (block,)):
        model = build()
        state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=3, units=units)
        step = fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm)
        for b in data:
            state, _ = step(state, comm.split_batch(b))
        out[units is None] = state
    assert out[True].module.units == out[False].module.units
    assert len(out[True].module.units) == 2
    for a, b in zip(out[True].shard.master, out[False].shard.master):
        assert torch.equal(a, b)


def test_default_units_outermost_only():
    """A listed class inside another listed one is not a unit of its own."""
    torch.manual_seed(0)
    model = cases.BranchUnits()
    model._no_split_modules = ["Sequential", "Linear"]
    assert fzero.units.default_units(model) == ("inp", "a", "extra", "b", "out")
    model._no_split_modules = ["Sequential"]
    assert fzero.units.default_units(model) == ("a", "extra", "b")


def test_without_units_a_plain_module_is_told_what_to_pass():
    comm = fzero.SimulatedWorld(2)
    with pytest.raises(ValueError, match=r"stage 3 needs the model's shard units, and Sequential names no blocks "
                                         r"\(no _no_split_modules.*\): pass units=\(BlockClass,\)"):
        fzero.init_train_state(torch.nn.Sequential(torch.nn.Linear(2, 2)), fzero.sgd(lr=0.1), comm, stage=3)
    model = um.gpt2()
    model._no_split_modules = ["NoSuchBlock"]
    with pytest.raises(ValueError, match=r"none of GPT2LMHeadModel's _no_split_modules \['NoSuchBlock'\] is a "
                                         r"submodule with parameters: pass units="):
        fzero.init_train_state(model, fzero.sgd(lr=0.1), comm, stage=3)


def test_units_policy_errors():
    comm = fzero.SimulatedWorld(2)
    with pytest.raises(ValueError, match=r"units=\(\) is empty: give module classes, e\.g\. "
                                         r"units=\(TransformerBlock,\), a predicate \(name, module\) -> bool, "
                                         r"or leave units out for a transformers model"):
        fzero.init_train_state(um.gpt2(), fzero.sgd(lr=0.1), comm, stage=3, units=())
    with pytest.raises(TypeError, match=r"units: 1 \(int\) is not an nn\.Module class; give module classes"):
        fzero.init_train_state(um.gpt2(), fzero.sgd(lr=0.1), comm, stage=3, units=(1,))


# --- a unit whose output is unused ----------------------------------------------------------


class SideUnit(torch.nn.Module):
    """Units ``a``, ``side`` and ``b``: ``side`` runs on every rank but its output is unused
    (a probe, an auxiliary head switched off): its gradient is zero, reduced after backward."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 6)
        self.side = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.side(h)  # computed, then dropped
        return self.b(h)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_unit_whose_output_is_unused_float64(world):
    torch.manual_seed(0)
    model = SideUnit().double()
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(2 * world, 4, generator=g, dtype=torch.float64),
             torch.randn(2 * world, 3, generator=g, dtype=torch.float64)) for _ in range(3)]
    make_fz, make_torch = OPTIMIZERS["sgd"]
    ref, _, ref_losses = um.oracle_run(model, make_torch, data, world, lambda m, b: F.mse_loss(m(b[0]), b[1]))
    comm = fzero.SimulatedWorld(world)
    mine = copy.deepcopy(model)
    state = fzero.init_train_state(mine, make_fz(), comm, stage=3, units=(torch.nn.Linear,))
    assert state.module.units == ("a", "side", "b")
    step = fzero.make_train_step(fzero.module_loss(mine, F.mse_loss), comm)
    losses = []
    for b in data:
        state, m = step(state, comm.split_batch(b))
        losses.append(m["loss"].item())
    assert_params_match(state, comm, ref, 1e-12)
    full = fzero.full_params(state.shard, comm)
    assert torch.equal(full["side.weight"][0], model.side.weight.detach())  # a zero gradient: unchanged
    assert losses == pytest.approx(ref_losses, rel=1e-6)
