"""Expert parallelism (``fzero.moe``) with parameter groups: tiny ``transformers`` Mixtral and Qwen2-MoE models
converted at EP = 2 on a simulated W = 4 (rows in lockstep at each all-to-all), stages 1-3, accumulation 1 and 2,
clipping that binds, against a single-process oracle holding every expert (float64): parameters within 1e-10; the
all-to-all's bytes against the routing; named errors. Four gloo ranks against this world bitwise:
``test_moe_gloo.py``."""

from __future__ import annotations

import pytest
import torch

import fzero
import fzero.moe as moe
import moe_cases as mc
from fzero.comm import CountingCommunicator, SimulatedWorld
from fzero.lockstep import Lockstep, LockstepError

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
    """SGD with clipping that binds: the clip factor scales every update, so a norm counting an expert twice (or a
    rank group's experts not at all) would move the parameters far beyond 1e-10."""
    want = mc.run_oracle(kind, clip, accum, opt=opt)
    got = mc.run_fzero(kind, _world(), stage, clip, accum, opt=opt)
    _assert_rows(got["params"], mc.expected_rows(want, got["experts"], range(mc.W)))
    for a, b in zip(got["losses"] + got["norms"], want["losses"] + want["norms"]):
        assert abs(a - b) <= 1e-6 * abs(b)  # the step's metrics are float32
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
