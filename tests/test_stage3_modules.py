"""ZeRO stage 3 for any nn.Module (shard units from a wrap policy), against the plain-torch
W-rank oracle and against stage 2; gathered memory; clear errors.

Models: HF GPT-2 (tied embeddings, in the root) and Llama built tiny from configs, a BatchNorm
ResNet, a model with tuple activations between units and dict inputs, dropout under the seeding
contract, activation checkpointing (HF's and torch's own).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fzero
import user_models as um
from fzero.testing import GatherTracker
from test_user_models import OPTIMIZERS, _data, assert_buffers_match, assert_params_match, rel_err

transformers = pytest.importorskip("transformers")
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

from helpers import CHEAP_COMPILE


class TupleBlock(torch.nn.Module):
    """Takes and returns a tuple ``(h, gate)``; the gate is a second activation between units."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.gate = torch.nn.Linear(d, d, bias=False)

    def forward(self, hg: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, g = hg
        return h + torch.tanh(self.lin(h)) * torch.sigmoid(g), self.gate(h) + g


class DictModel(torch.nn.Module):
    """Keyword inputs ``x`` and ``mask``; tuple activations between units; a residual head."""

    def __init__(self, d: int = 6, classes: int = 3):
        super().__init__()
        self.embed = torch.nn.Linear(4, d)
        self.blocks = torch.nn.ModuleList(TupleBlock(d) for _ in range(3))
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> dict:
        h = self.embed(x)
        hg = (h, h * 0.5)
        for b in self.blocks:
            hg = b(hg)
        h = (hg[0] + hg[1]) * mask.unsqueeze(-1)
        return {"logits": self.head(h.sum(1))}


def dict_model(seed: int = 0) -> DictModel:
    torch.manual_seed(seed)
    return DictModel()


def dict_batches(n: int, batch: int, dtype: torch.dtype) -> list:
    g = torch.Generator().manual_seed(3)
    return [
        ({"x": torch.randn(batch, 5, 4, generator=g, dtype=dtype),
          "mask": (torch.rand(batch, 5, generator=g) > 0.3).to(dtype)},
         torch.randint(0, 3, (batch,), generator=g))
        for _ in range(n)
    ]


# kind: (builder(checkpointing) -> model, units, loss kind)
MODELS = {
    "gpt2": (lambda c=False: um.gpt2(checkpointing=c), (GPT2Block,), "lm"),
    "llama_labels": (lambda c=False: um.llama(checkpointing=c), (LlamaDecoderLayer,), "labels"),
    "resnet_bn": (lambda c=False: um.resnet(checkpoint=c), (um.Block,), "image"),
    "dict_tuple": (lambda c=False: dict_model(), lambda name, m: name in ("blocks.0", "blocks.1", "blocks.2"), "dict"),
}


def data_for(kind: str, world: int, dtype: torch.dtype, n: int = 4) -> list:
    if kind == "dict":
        return dict_batches(n, world * 2, dtype)
    return _data(kind, world, dtype, n)


def loss_for(model: torch.nn.Module, kind: str):
    if kind == "labels":
        return fzero.module_loss(model)
    if kind == "lm":
        return fzero.module_loss(model, um.lm_criterion)
    return fzero.module_loss(model, F.cross_entropy)


def oracle_loss(kind: str):
    if kind == "dict":
        return lambda model, b: F.cross_entropy(model(**b[0])["logits"], b[1])
    return um.oracle_loss(kind)


def run(model, units, kind, data, world, *, stage, opt, compile=False, seed=0, comm=None):
    comm = comm or fzero.SimulatedWorld(world)
    model = copy.deepcopy(model)  # a stage-3 state takes the module's parameters (they move to meta)
    state = fzero.init_train_state(model, opt, comm, stage=stage, units=units, seed=seed)
    step = fzero.make_train_step(loss_for(model, kind), comm, compile=compile)
    losses = []
    for batch in data:
        state, m = step(state, comm.split_batch(batch))
        losses.append(m["loss"].item())
    return state, comm, losses


F64_TOL = {"gpt2": 1e-10, "resnet_bn": 1e-10, "dict_tuple": 1e-10, "llama_labels": 1e-6}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_stage3_parity_float64(name, world):
    build, units, kind = MODELS[name]
    opt = "sgd" if world % 2 else "adamw"
    model = build().double()
    data = data_for(kind, world, torch.float64, n=3)
    make_fz, make_torch = OPTIMIZERS[opt]
    ref, replicas, ref_losses = um.oracle_run(model, make_torch, data, world, oracle_loss(kind))
    state, comm, losses = run(model, units, kind, data, world, stage=3, opt=make_fz())
    assert not state.params  # nothing gathered is kept between steps
    assert_params_match(state, comm, ref, F64_TOL[name])
    assert_buffers_match(state, replicas)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


@pytest.mark.parametrize(
    "name,checkpointing",
    [(name, c) for name in sorted(MODELS) for c in (False, True) if not (c and name == "dict_tuple")],
)
def test_stage3_bitwise_equals_stage2_float32(name, checkpointing):
    build, units, kind = MODELS[name]
    world = 3
    data = data_for(kind, world, torch.float32)
    out = {}
    for stage in (2, 3):
        out[stage] = run(build(checkpointing), units, kind, data, world, stage=stage, opt=fzero.adamw(lr=1e-2))
    (s2, _, l2), (s3, _, l3) = out[2], out[3]
    assert l2 == l3
    for a, b in zip(s2.shard.master, s3.shard.master):
        assert torch.equal(a, b)
    for a, b in zip(s2.buffers, s3.buffers):
        assert torch.equal(a, b)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_stage3_dropout_follows_the_seeding_contract(world):
    """Dropout drawn once per step (no recomputed forward), each rank from its own generator."""
    model = um.gpt2(dropout=0.1).double()
    data = data_for("lm", world, torch.float64, n=4)
    make_fz, make_torch = OPTIMIZERS["adamw"]
    ref, _, ref_losses = um.oracle_run(model, make_torch, data, world, um.oracle_loss("lm"), seed=7)
    state, comm, losses = run(model, (GPT2Block,), "lm", data, world, stage=3, opt=make_fz(), seed=7)
    assert_params_match(state, comm, ref, 1e-10)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


@pytest.mark.parametrize("name", ["gpt2", "llama_labels", "resnet_bn"])
def test_stage3_activation_checkpointing_parity_float64(name):
    """HF's gradient checkpointing (GPT-2, Llama) and torch's own inside a unit (ResNet
    blocks) against the oracle running the same checkpointed model."""
    build, units, kind = MODELS[name]
    world = 2
    model = build(True).double()
    data = data_for(kind, world, torch.float64, n=3)
    make_fz, make_torch = OPTIMIZERS["adamw"]
    ref, replicas, ref_losses = um.oracle_run(model, make_torch, data, world, oracle_loss(kind))
    state, comm, losses = run(model, units, kind, data, world, stage=3, opt=make_fz())
    assert_params_match(state, comm, ref, F64_TOL[name])
    assert_buffers_match(state, replicas)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


def test_stage3_dropout_with_checkpointing_equals_without():
    data = data_for("lm", 2, torch.float32)
    runs = [run(um.gpt2(dropout=0.1, checkpointing=c), (GPT2Block,), "lm", data, 2, stage=3,
                opt=fzero.adamw(lr=1e-2), seed=5) for c in (False, True)]
    assert runs[0][2] == runs[1][2]
    for a, b in zip(runs[0][0].shard.master, runs[1][0].shard.master):
        assert torch.equal(a, b)


def test_tied_sequential_at_stage3():
    """A tied nn.Sequential (embedding and head share a weight): the weight goes to the root."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 6)
    head = torch.nn.Linear(6, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), head).double()
    units = lambda name, m: isinstance(m, torch.nn.Linear)  # noqa: E731 - selects the head too
    comm = fzero.SimulatedWorld(2)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 10, (4, 3), generator=g), torch.randint(0, 10, (4, 3), generator=g)) for _ in range(3)]
    crit = lambda out, y: F.cross_entropy(out.reshape(-1, 10), y.reshape(-1))  # noqa: E731
    ref, _, _ = um.oracle_run(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), data, 2,
                              lambda m, b: crit(m(b[0]), b[1]))
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm, stage=3, units=units)
    assert state.module.units == ("1", "3", "4")
    buckets = {s.path: s.bucket for s in state.layout.slots}
    assert buckets["0.weight"] == 0  # registered in unit "4" and outside it: the root
    step = fzero.make_train_step(fzero.module_loss(model, crit), comm)
    for b in data:
        state, _ = step(state, comm.split_batch(b))
    assert_params_match(state, comm, ref, 1e-12)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_stage3_gathers_at_most_two_units_beyond_the_root(checkpointing):
    model = um.gpt2(checkpointing=checkpointing)
    model.transformer.h.extend([type(model.transformer.h[0])(model.config, layer_idx=i) for i in (2, 3)])
    model.config.n_layer = 4
    tracker = GatherTracker(fzero.SimulatedWorld(2))
    state = fzero.init_train_state(model, fzero.adamw(), tracker, stage=3, units=(GPT2Block,))
    step = fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), tracker)
    size = [0] * (len(state.module.units) + 1)
    for g in state.layout.groups:
        size[g.bucket] += g.padded_numel * 4
    assert tracker.live_bytes == 0
    batch = tracker.split_batch(_data("lm", 2, torch.float32, n=1)[0])
    state, _ = step(state, batch)
    assert tracker.live_bytes == 0  # no full parameter held between steps
    tracker.reset_peak()
    state, _ = step(state, batch)
    assert size[0] + max(size[1:]) <= tracker.peak_bytes <= size[0] + 2 * max(size[1:])
    assert tracker.peak_bytes < sum(size)


def test_stage3_state_memory_is_sharded():
    """Per rank the state holds the fp32 master and Adam's two moments of one shard (12 Psi / N
    plus padding) and no parameters; the report adds 16-bit parameters and gradients that live
    only inside a step, the ZeRO paper's 16 Psi / N."""
    model = um.llama()
    world = 4
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.adamw(), comm, stage=3, units=(LlamaDecoderLayer,))
    psi = sum(p.numel() for p in model.parameters())
    padded = state.layout.num_padded
    per_rank = sum(m[0].numel() * m.element_size() for m in state.shard.master)
    per_rank += sum(x[0].numel() * x.element_size() for ms in state.opt.moments for x in ms)
    assert state.params == ()
    assert per_rank == 12 * padded // world
    bf16 = fzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    report = fzero.memory_report(state.layout, fzero.adamw(), stage=3, precision=bf16)
    assert report.total - report.padding == pytest.approx(fzero.memory.zero_paper_bytes(psi, 3, world), rel=1e-12)
    assert report.held_total == pytest.approx(per_rank)


def test_stage3_compiled_equals_eager_without_recompiles():
    model = um.gpt2()
    data = data_for("lm", 2, torch.float32, n=4)
    torch._dynamo.reset()
    counters.clear()
    opt = fzero.sgd(lr=0.1, momentum=0.9)
    # inductor on compiled stage 3 with every unit gathered at once: test_zero3's MLP; on GPT-2
    # with its blocks regathered: test_compose_by_hand and test_user_models_gloo
    compiled, _, lc = run(model, (GPT2Block,), "lm", data, 2, stage=3, opt=opt, compile=CHEAP_COMPILE)
    eager, _, le = run(model, (GPT2Block,), "lm", data, 2, stage=3, opt=opt)
    assert lc == pytest.approx(le, rel=1e-4)
    for x, y in zip(compiled.shard.master, eager.shard.master):
        assert rel_err(x, y) <= 1e-4
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_checkpoints_move_between_stage3_and_stage2(tmp_path):
    model = um.gpt2()
    comm = fzero.SimulatedWorld(2)
    data = data_for("lm", 2, torch.float32, n=2)
    s3, _, _ = run(model, (GPT2Block,), "lm", data, 2, stage=3, opt=fzero.adamw(), comm=comm)
    path = fzero.save_checkpoint(s3, tmp_path, comm)
    a = fzero.full_params(s3.shard, comm)
    w3 = fzero.SimulatedWorld(3)
    # into stage 2 (no units: another bucketing) at W=3, and back into stage 3 at W=3
    template = fzero.init_train_state(um.gpt2(), fzero.adamw(), w3, stage=2)
    loaded, _ = fzero.load_checkpoint(path, template, w3)
    path2 = fzero.save_checkpoint(loaded, tmp_path / "again", w3)
    template3 = fzero.init_train_state(um.gpt2(), fzero.adamw(), w3, stage=3, units=(GPT2Block,))
    back, _ = fzero.load_checkpoint(path2, template3, w3)
    for st in (loaded, back):
        b = fzero.full_params(st.shard, w3)
        for k in a:
            assert torch.equal(a[k][0], b[k][0]), k
        assert torch.equal(st.opt.step, s3.opt.step)


# --- errors -------------------------------------------------------------------------------


def test_a_policy_that_selects_nothing():
    with pytest.raises(ValueError, match="selects no submodule with parameters of GPT2LMHeadModel"):
        fzero.init_train_state(um.gpt2(), fzero.adamw(), fzero.SimulatedWorld(2), stage=3,
                               units=(LlamaDecoderLayer,))


def test_nested_units():
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn' lies inside unit 'transformer.h.0'"):
        fzero.init_train_state(um.gpt2(), fzero.adamw(), fzero.SimulatedWorld(2), stage=3,
                               units=lambda name, m: name in ("transformer.h.0", "transformer.h.0.attn"))


def test_stage3_needs_units_of_a_module():
    # a transformers model names its blocks (the default units: tests/test_unit_calls.py); a
    # plain module does not
    with pytest.raises(ValueError, match="stage 3 needs the model's shard units, and ResNet names no blocks"):
        fzero.init_train_state(um.resnet(), fzero.adamw(), fzero.SimulatedWorld(2), stage=3)
    with pytest.raises(TypeError, match="stage 3 shards an nn.Module unit by unit, got dict"):
        fzero.init_train_state({"w": torch.zeros(3)}, fzero.adamw(), fzero.SimulatedWorld(2), stage=3)
    with pytest.raises(TypeError, match="chooses submodules of an nn.Module"):
        fzero.init_train_state({"w": torch.zeros(3)}, fzero.adamw(), fzero.SimulatedWorld(2), stage=3,
                               units=(torch.nn.Linear,))
    with pytest.raises(TypeError, match="needs the module"):
        fzero.make_train_step(lambda p, b: p["w"].sum(), fzero.SimulatedWorld(2), stage=3)


def test_parameters_changed_between_init_and_step():
    model = um.gpt2()
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, fzero.adamw(), comm, stage=3, units=(GPT2Block,))
    model.transformer.wte = torch.nn.Embedding(um.VOCAB + 8, 16)  # a layer resized after init
    step = fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm)
    with pytest.raises(ValueError, match=r"'transformer.wte.weight' of the state is \(32, 16\).*now has \(40, 16\)"):
        step(state, comm.split_batch(_data("lm", 2, torch.float32, n=1)[0]))


class UsesOtherUnit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.b(x) + x @ self.a.weight  # a's weight, used outside unit "a"


def test_a_unit_parameter_used_outside_its_unit_is_named():
    model = UsesOtherUnit()
    comm = fzero.SimulatedWorld(1)
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm, stage=3, units=(torch.nn.Linear,))
    step = fzero.make_train_step(fzero.module_loss(model, F.mse_loss), comm)
    batch = comm.split_batch((torch.randn(2, 3), torch.randn(2, 3)))
    with pytest.raises(RuntimeError, match=r"parameter 'a.weight' was used .* outside the forward of the unit"):
        step(state, batch)
    # the module is left as it was
    assert isinstance(model.a.weight, torch.nn.Parameter) and type(model.a.weight) is torch.nn.Parameter
    assert not model.a._forward_hooks and not model.a._forward_pre_hooks


def test_stage3_bf16_with_frozen_parameters_bitwise_equals_stage2():
    """16-bit compute (the unit gathered in bf16) and a frozen parameter inside a unit."""
    data = data_for("lm", 2, torch.float32, n=3)
    bf16 = fzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    out = {}
    for stage in (2, 3):
        model = um.gpt2()
        model.transformer.h[0].ln_1.weight.requires_grad_(False)
        comm = fzero.SimulatedWorld(2)
        state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage, units=(GPT2Block,),
                                       precision=bf16)
        assert "transformer.h.0.ln_1.weight" not in [s.path for s in state.layout.trainable_slots]
        step = fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm)
        for b in data:
            state, m = step(state, comm.split_batch(b))
        out[stage] = state
    for a, b in zip(out[2].shard.master, out[3].shard.master):
        assert torch.equal(a, b)
    assert not torch.equal(out[3].shard.master[0], fzero.init_train_state(
        um.gpt2(), fzero.adamw(), fzero.SimulatedWorld(2), stage=3, units=(GPT2Block,)).shard.master[0])
