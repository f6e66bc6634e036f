"""``memory_report`` against the census of real eager steps on the simulated world (gloo:
tests/test_census_stage3_gloo.py): what the state holds, what the module's own parameters hold
beside it (to the byte), the new state a pure step makes, and the step's own buffers at their
joint peak within 10 %.

The report computes the step's buffers from the layout (buckets, gathered units, gradient
shards) and each communicator's stated factor for its collectives' buffers; it replays no
schedule, so it is held to 10 %, not to the byte."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as tp

import fzero
from fzero.scopes import GATHER, GRAD_BUCKETS, GRAD_REDUCTION
from fzero.testing import Census
from helpers import mlp

MIB = 2.0**20
BF16 = fzero.MixedPrecision(torch.bfloat16, torch.bfloat16)


def _gpt2():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    import user_models as um

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=um.VOCAB, n_positions=um.SEQ, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager", use_cache=False)).train()
    return model, fzero.module_loss(model, um.lm_criterion), lambda world: um.token_batches(1, 2 * world)[0], None


def _mlp():
    torch.manual_seed(0)
    model = mlp(sizes=(64, 256, 256, 256, 256, 16))
    return (model, fzero.module_loss(model, torch.nn.functional.mse_loss),
            lambda world: (torch.randn(4 * world, 64), torch.randn(4 * world, 16)),
            lambda name, m: name in ("0", "3", "5", "7", "9"))


def _census(kind: str, world: int, stage: int, precision: fzero.MixedPrecision, donate: bool = False,
            frozen: bool = False):
    model, loss, batch_of, units = {"mlp": _mlp, "gpt2": _gpt2}[kind]()
    if frozen:  # the first Linear's weight
        next(model.parameters()).requires_grad_(False)
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.adamw(), comm, stage=stage, precision=precision,
                                   units=units if stage == 3 else None, bucket_numel=20_000 if stage < 3 else None)
    step = fzero.make_train_step(loss, comm, donate=donate)
    batch = comm.split_batch(batch_of(world))
    state, _ = step(state, batch)  # warm-up: lazily built pieces
    rep = fzero.memory_report(state.layout, state.opt.optimizer, stage=stage, comm=comm, precision=precision,
                              donate=donate)
    held = {"s": state}
    del state
    census = Census(known={"held": tp.tree_leaves(held["s"]), "module": list(model.parameters()),
                           "new state": lambda: tp.tree_leaves(held["s"])})
    with census:
        held["s"], _ = step(held["s"], batch)
    return model, comm, held["s"], rep, census


@pytest.mark.parametrize("kind", ["mlp", "gpt2"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", [fzero.MixedPrecision(), BF16], ids=["fp32", "bf16"])
def test_step_buffers_within_ten_percent_of_the_census(kind, world, stage, precision):
    """The step's own buffers (profiler scopes: stages 1-2 the gradient buckets and reductions,
    stage 3 the gathers and reductions) at their joint peak within 10 %."""
    _, comm, _, rep, census = _census(kind, world, stage, precision)
    R = comm.local_ranks
    scopes = (GRAD_BUCKETS, GRAD_REDUCTION) if stage < 3 else (GATHER, GRAD_REDUCTION)
    joint = census.joint_peak(scopes)
    print(f"\n{kind} W={world} stage {stage}: census {census.scope_peaks} joint {joint}; report "
          f"{ {k: v * R for k, v in rep.step_buffers.items()} } joint {rep.step_peak * R}")
    assert abs(joint - rep.step_peak * R) <= 0.1 * joint


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("donate", [False, True])
def test_held_and_new_state_as_memory_report_says(stage, donate):
    """The state's tensors before the step are ``held_total`` per rank within 1 % (the rest: the
    generator states and 0-d scalars); the module holds ``module_params`` beside it (fp32: none
    with donation, the first state's gathered buffers after a pure step; stage 3: none); a pure
    step makes a whole new state, a donating one reuses master shards and moments."""
    model, comm, state, rep, census = _census("mlp", 2, stage, fzero.MixedPrecision(), donate)
    R = comm.local_ranks
    assert census.baseline["held"] == pytest.approx(R * rep.held_total, rel=0.01)
    assert census.baseline["held"] >= R * rep.held_total
    if stage == 3:
        assert census.baseline.get("module", 0) == 0 == rep.module_params
    elif donate:
        assert {p.untyped_storage().data_ptr() for p in model.parameters()} <= {
            t.untyped_storage().data_ptr() for t in state.params}
        assert census.baseline.get("module", 0) == 0 == rep.module_params
    else:  # views of the first state's buffers, which nothing else holds now
        assert census.baseline["module"] == R * rep.held["params"] == R * rep.module_params
    assert census.peak_bytes >= R * rep.transient_total
    new = census.in_block_by_category.get("new state", 0)
    made = census.end_by_category.get("new state", 0)
    if donate:
        reused = R * (rep.held["master"] + rep.held["moments"])
        assert made <= R * rep.held_total - reused + 0.01 * R * rep.held_total
    else:
        assert made == pytest.approx(R * rep.held_total, rel=0.01)
    assert new <= made


KEEP_LN = fzero.MixedPrecision(torch.bfloat16, torch.bfloat16, keep_dtype=(torch.nn.LayerNorm,))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("precision", [fzero.MixedPrecision(), BF16, KEEP_LN], ids=["fp32", "bf16", "bf16-keep-ln"])
def test_module_params_as_the_census_measures(stage, donate, precision):
    """What the module's parameters hold that the state's tensors do not (the census's ``module``
    baseline: storages ``held`` did not claim, one step after a warm-up) is ``module_params`` to
    the byte, a frozen weight among them: under bf16 at stages 1-2 every fp32 original (4 bytes a
    parameter), a kept LayerNorm's view of the first state's buffer after pure steps, none at
    stage 3; and the state and module together are ``held_with_module`` within 1 % (the report
    counts a stage-1-2 frozen parameter whole on every rank, as a real rank holds it; the
    simulated ranks share the process's one)."""
    model, comm, state, rep, census = _census("mlp", 2, stage, precision, donate, frozen=True)
    R = comm.local_ranks
    got = census.baseline.get("module", 0)
    assert got == pytest.approx(R * rep.module_params, rel=1e-12), (got, R * rep.module_params)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # fp32, all cast to bf16 under BF16
    if stage < 3 and precision is BF16:  # the issue's +4 bytes per trainable fp32 parameter
        assert got == 4 * trainable
    elif stage == 3 or (donate and precision.param_dtype is None):
        assert got == 0
    together = census.baseline["held"] + got
    shared = (R - 1) * rep.held["frozen"] if stage < 3 else 0
    assert together == pytest.approx(R * rep.held_with_module - shared, rel=0.01)
    assert together >= R * rep.held_with_module - shared
