"""Expert parallelism (``fzero.moe``) with parameter groups: tiny ``transformers`` Mixtral and Qwen2-MoE models
converted at EP = 2 on a simulated W = 4 (rows in lockstep at each all-to-all), stages 1-3, accumulation 1 and 2,
clipping that binds, against a single-process oracle holding every expert (float64): parameters within 1e-10; the
all-to-all's bytes against the routing; named errors. Four gloo ranks against this world bitwise:
``test_moe_gloo.py``."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as tp

import fzero
import fzero.moe as moe
import moe_cases as mc
from fzero.comm import CountingCommunicator, SimulatedWorld
from fzero.lockstep import Lockstep, LockstepError
from fzero.testing import Census

pytestmark = pytest.mark.usefixtures("one_thread")


def _world() -> SimulatedWorld:
    return SimulatedWorld(mc.W, groups=moe.expert_groups(mc.W, mc.EP))


def _assert_rows(got: list[dict], want: list[dict], tol: float = 1e-10) -> None:
    for r, (g, w) in enumerate(zip(got, want)):
        for name, value in w.items():
            err = (g[name] - value).abs().max().item()
            assert err <= tol, f"rank {r} {name}: error {err:.3g} > {tol}"


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt,clip,accum", [("adamw", None, 1), ("sgd", 0.05, 2)])
def test_expert_parallel_trains_as_the_oracle(kind, stage, opt, clip, accum):
    """The global norm within 1e-10 of the oracle's, the loss (with the load-balancing term; float32, as transformers
    computes it) within its rounding; SGD with clipping
    that binds: the clip factor scales every update, so a norm counting an expert twice (or a rank group's experts not
    at all) would move the parameters far beyond 1e-10."""
    want = mc.run_oracle(kind, clip, accum, opt=opt)
    got = mc.run_fzero(kind, _world(), stage, clip, accum, opt=opt)
    _assert_rows(got["params"], mc.expected_rows(want, got["experts"], range(mc.W)))
    for a, b in zip(got["norms"], want["norms"]):
        assert abs(a - b) <= 1e-10, (got["norms"], want["norms"])
    for a, b in zip(got["losses"], want["losses"]):  # transformers computes the loss in float32 (its logits upcast)
        assert abs(a - b) <= 2e-7 * abs(b), (got["losses"], want["losses"])
    if clip is not None:
        assert min(want["norms"]) > 10 * clip
    assert got["state"].layout.axes == (("experts", 2, 2),)


def test_the_all_to_all_moves_the_routed_tokens():
    """One step's all-to-all bytes on the expert-parallel axis, against the routers' choices: per layer and row, the
    (token, slot) pairs whose expert lives on the other rank of its group, H float64 each, four times (there and back
    in forward, and in backward), and the counts (E / EP int64 to the other rank, forward only); the experts'
    gradients reduced within their groups, the dense ones over the world."""
    counter = CountingCommunicator(_world())
    record: list = []
    got = mc.run_fzero("mixtral", counter.inner, 2, None, steps=1, counter=counter, record=record)
    hidden, local = 16, 4 // mc.EP
    expected = 0.0
    assert len(record) == 2 * mc.W  # two layers, every row
    for row, chosen in record:
        mine = row % mc.EP
        away = int(((chosen // local) != mine).sum())
        expected += 4 * away * hidden * 8 + (mc.EP - 1) * local * 8
    assert counter.totals(["all_to_all"], axis=moe.EXPERT_PARALLEL)["bytes"] == expected
    lay = got["state"].layout
    for axis, name in (("", "shard"), ("experts", "experts")):
        padded = sum(g.padded_numel for g in lay.groups if g.axis == axis)
        assert counter.totals(["reduce_scatter"], axis=name)["elements"] == padded


def test_memory_report_counts_each_rank_its_own_experts_over_their_group():
    """Stage 3, bf16 compute and reduction, fp32 master and AdamW moments: 16 bytes per expert parameter this rank
    holds (E / EP experts of each block) / (W / EP), 16 per dense one / W; the state's tensors hold the report's
    master and moments (their storage, per rank of the 4 in this process)."""
    m = mc.model("mixtral").float()
    experts = moe.expert_parallel(m, _world())
    state = fzero.init_train_state(m, fzero.adamw(), _world(), stage=3, groups={moe.EXPERTS: experts},
                                   precision=fzero.MixedPrecision(torch.bfloat16, torch.bfloat16))
    report = fzero.memory_report(state.layout, state.opt.optimizer, stage=3, precision=state.precision)
    mine = sum(p.numel() for n, p in m.named_parameters() if n in experts.paths)  # E / EP experts a block
    dense = sum(p.numel() for n, p in m.named_parameters() if n not in experts.paths)
    lay = state.layout
    padding = sum(g.padding / lay.axis_size(g.axis) for g in lay.groups)
    total = sum(report.held.values()) + report.transient["params"] + report.transient["grads"]
    assert total == pytest.approx(16 * mine / (mc.W // mc.EP) + 16 * dense / mc.W + 16 * padding)
    held = report.held["master"] + report.held["moments"]
    rows = [*state.shard.master, *(t for ms in state.opt.moments for t in ms)]
    assert sum(t.untyped_storage().nbytes() for t in rows) / mc.W == held
    # the census of a step: what the state held before it is the report's (within its 0-d scalars and step counts)
    step = fzero.make_train_step(fzero.module_loss(m), _world())
    batch = _world().split_batch(mc.batches(1, mc.W)[0])
    state, _ = step(state, batch)  # warm-up
    kept = {"s": state}
    del state
    rng = {id(t) for t in kept["s"].rng}  # the generators' states: not parameters (5 kB a rank on the CPU)
    census = Census(known={"held": [t for t in tp.tree_leaves(kept["s"]) if id(t) not in rng]})
    with census:
        kept["s"], _ = step(kept["s"], batch)
    assert mc.W * report.held_total <= census.baseline["held"] <= 1.01 * mc.W * report.held_total


def test_expert_parallel_errors_are_named():
    with pytest.raises(ValueError, match="must divide the world size, got ep=3 for 4 ranks"):
        moe.expert_groups(4, 3)
    with pytest.raises(ValueError, match="has no sparse block"):
        moe.expert_parallel(torch.nn.Linear(2, 2), _world())
    comm = SimulatedWorld(6, groups=moe.expert_groups(6, 3))
    with pytest.raises(ValueError, match="has 4 experts, which 3 expert-parallel ranks do not divide"):
        moe.expert_parallel(mc.model("mixtral"), comm)
    with pytest.raises(ValueError, match="has no parameter groups"):
        moe.expert_parallel(mc.model("mixtral"), SimulatedWorld(4))
    m = mc.model("mixtral")
    moe.expert_parallel(m, _world())
    with pytest.raises(RuntimeError, match="runs inside fzero's step"):  # outside a step, no row meets the others
        m(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_expert_parallel_in_one_process_is_eager_only():
    m = mc.model("mixtral")
    experts = moe.expert_parallel(m, _world())
    state = fzero.init_train_state(m, fzero.adamw(), _world(), groups={moe.EXPERTS: experts})
    step = fzero.make_train_step(fzero.module_loss(m), _world(), compile={"backend": "aot_eager"})
    with pytest.raises(Exception, match="runs eagerly in a simulated world of 4 rows: compile=False"):
        step(state, _world().split_batch(mc.batches(1, mc.W)[0]))


def test_rows_that_meet_differently_fail_on_every_row():
    """A row that ends without coming to a meeting the others wait at: a LockstepError, never a hang."""
    def body(r: int) -> int:
        if r != 1:
            steps.meet(r, "all_to_all", r, lambda values: values)
        return r

    steps = Lockstep(3)
    with pytest.raises(LockstepError, match="rows \\[0, 2\\] wait at all_to_all, but rows \\[1\\] ended"):
        steps.run(body)
    steps = Lockstep(2)
    with pytest.raises(LockstepError, match="row 0 at a, row 1 at b"):
        steps.run(lambda r: steps.meet(r, "ab"[r], r, lambda values: values))
    steps = Lockstep(3)
    assert steps.run(lambda r: steps.meet(r, "x", r, lambda values: [sum(values)] * 3) + r) == [3, 4, 5]


def test_checkpoints_move_between_expert_parallel_degrees(tmp_path):
    """Saved at EP = 2 on W = 4 after two steps: the whole model (every expert by index) is the oracle's; loaded at
    EP = 4, at EP = 1 on W = 2, into the unconverted model on W = 2 and at stage 3, every value bitwise (the momentum
    too: one more step at EP = 4 is the oracle's third); offline consolidation gives the same whole model."""
    from fzero.checkpoint import consolidate_model_state_dict, export_model_state_dict, load_checkpoint, save_checkpoint

    got = mc.run_fzero("mixtral", _world(), 2, 0.05, opt="sgd", steps=2)
    save_checkpoint(got["state"], tmp_path, _world())
    whole = export_model_state_dict(got["state"], _world())
    want = mc.run_oracle("mixtral", 0.05, opt="sgd", steps=3)
    two = mc.run_oracle("mixtral", 0.05, opt="sgd", steps=2)
    for name, value in two["params"].items():
        assert (whole[name] - value).abs().max() < 1e-10, name
    offline = consolidate_model_state_dict(tmp_path)
    assert all(torch.equal(offline[k], whole[k]) for k in whole)
    for world, ep, stage in [(4, 4, 2), (2, 1, 2), (2, None, 2), (2, 2, 3)]:
        comm = SimulatedWorld(world, groups=moe.expert_groups(world, ep)) if ep else SimulatedWorld(world)
        m = mc.model("mixtral")
        groups = {moe.EXPERTS: moe.expert_parallel(m, comm)} if ep else None
        template = fzero.init_train_state(m, fzero.sgd(lr=0.5, momentum=0.9), comm, stage=stage, groups=groups)
        state, _ = load_checkpoint(tmp_path, template, comm)
        again = export_model_state_dict(state, comm)
        assert all(torch.equal(again[k], whole[k]) for k in whole), (world, ep)
        if (world, ep) == (4, 4):  # the third step from the loaded state: the oracle's
            step = fzero.make_train_step(fzero.module_loss(m), comm, clip_norm=0.05)
            state, _ = step(state, comm.split_batch(mc.batches(3, world)[2]))
            third = export_model_state_dict(state, comm)
            for name, value in want["params"].items():
                assert (third[name] - value).abs().max() < 1e-10, name


def test_a_rank_group_that_sat_out_other_steps_is_named_when_rank_groups_merge(tmp_path):
    """Rank group 1's slice of an expert tensor sat out a step rank group 0's did not (no token reached those
    experts): at EP = 4 each new rank group takes the count of the saved one it lies in; at EP = 1 one rank group would
    hold both counts: a named CheckpointMismatchError, not a silent choice."""
    from fzero.checkpoint import CheckpointMismatchError, load_checkpoint, save_checkpoint
    from fzero.layout import positions

    got = mc.run_fzero("mixtral", _world(), 2, None, steps=1)
    state, lay = got["state"], got["state"].layout
    name = "model.layers.0.mlp.experts.gate_up_proj"
    slot = next(i for i, s in enumerate(lay.slots) if s.path == name)
    missed = state.opt.missed[0].clone()
    missed[positions(lay)[(slot, 1)]] = 1  # rank group 1's experts 2 and 3 sat out one step
    save_checkpoint(state.replace(opt=state.opt.replace(missed=(missed,), all_stepped=False)), tmp_path, _world())

    def template(world: int, ep: int):
        comm = SimulatedWorld(world, groups=moe.expert_groups(world, ep))
        m = mc.model("mixtral")
        groups = {moe.EXPERTS: moe.expert_parallel(m, comm)}
        return fzero.init_train_state(m, fzero.adamw(lr=1e-2, weight_decay=0.1), comm, groups=groups), comm

    four, comm = template(4, 4)
    loaded, _ = load_checkpoint(tmp_path, four, comm)
    where, index = positions(four.layout), fzero.layout.trainable_index(four.layout)
    slot4 = next(i for i, s in enumerate(four.layout.slots) if s.path == name)
    counts = [loaded.opt.missed[0][index[slot4] if q == 0 else where[(slot4, q)]].item() for q in range(4)]
    assert counts == [0, 0, 1, 1]
    one, comm = template(2, 1)
    with pytest.raises(CheckpointMismatchError, match=f"'{name}': its saved rank groups sat out different numbers"):
        load_checkpoint(tmp_path, one, comm)


def test_the_consolidated_torch_optim_state_is_the_oracles(tmp_path):
    """A checkpoint of the expert-parallel state consolidated offline into a ``torch.optim.AdamW`` state dict: every
    expert's moments by expert index, equal to the oracle's own AdamW state (which holds every expert)."""
    from fzero.checkpoint import consolidate_torch_optim_state_dict, save_checkpoint

    got = mc.run_fzero("mixtral", _world(), 2, None, steps=2)
    save_checkpoint(got["state"], tmp_path, _world())
    sd = consolidate_torch_optim_state_dict(tmp_path)
    m = mc.model("mixtral")
    optim = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    for batch in mc.batches(2, mc.W):  # the oracle's two steps, its optimizer kept
        parts = [{k: v.chunk(mc.W)[i] for k, v in batch.items()} for i in range(mc.W)]
        optim.zero_grad(set_to_none=True)
        for part in parts:
            (m(**part).loss / mc.W).backward()
        optim.step()
    want = optim.state_dict()
    assert sorted(sd["state"]) == sorted(want["state"])
    for k, state in want["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert (sd["state"][k][name] - state[name]).abs().max() < 1e-10, (k, name)
        assert float(sd["state"][k]["step"]) == float(state["step"])
