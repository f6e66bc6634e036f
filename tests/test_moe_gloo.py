"""Expert parallelism on four gloo ranks (``moe_worker.py``: each rank its own converted model, tokens by c10d's
``all_to_all_single``, the experts on their process groups) against the simulated world of ``test_moe.py``: bitwise
the same parameters, losses, norms and sat-out counts at stages 1-3, and the same all-to-all bytes."""

from __future__ import annotations

import pytest
import torch

import fzero.moe as moe
import moe_cases as mc
from dist_harness import run_torchrun
from fzero.comm import CountingCommunicator, SimulatedWorld
from moe_worker import CASES

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gloo():
    return run_torchrun(mc.W, "moe_worker.py", [*CASES, "ckpt", "disagree"], timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_gloo_expert_parallel_equals_the_simulated_world_bitwise(gloo, case):
    kind, stage, clip, accum, opt = CASES[case]
    counter = CountingCommunicator(SimulatedWorld(mc.W, groups=moe.expert_groups(mc.W, mc.EP)))
    sim = mc.run_fzero(kind, counter.inner, stage, clip, accum, opt=opt, counter=counter)
    sent = 0.0
    for rank in range(mc.W):
        got = gloo[rank][case]
        assert "exception" not in got, got.get("exception")
        for name, value in sim["params"][rank].items():
            assert torch.equal(value, got["params"][name]), (rank, case, name)
        assert sim["losses"] == got["losses"] and sim["norms"] == got["norms"]
        assert torch.equal(sim["state"].opt.missed[0], got["missed"])
        sent += got["all_to_all"]
    assert sent == counter.totals(["all_to_all"], axis=moe.EXPERT_PARALLEL)["bytes"]


def test_a_gloo_checkpoint_loads_at_another_degree_bitwise(gloo):
    """Saved by four gloo ranks at EP = 2 (stage 3), read by the simulated world at EP = 4 and by the unconverted
    model on two ranks: every value bitwise the gloo ranks' live export (every expert by index, broadcast from each
    rank group), which is the simulated run's."""
    import fzero
    from fzero.checkpoint import export_model_state_dict, load_checkpoint

    got = [gloo[r]["ckpt"] for r in range(mc.W)]
    assert all("exception" not in g for g in got), [g.get("exception") for g in got]
    whole = got[0]["whole"]
    assert all(all(torch.equal(g["whole"][k], whole[k]) for k in whole) for g in got)
    sim = mc.run_fzero("mixtral", SimulatedWorld(mc.W, groups=moe.expert_groups(mc.W, mc.EP)), 3, 0.05, opt="sgd",
                       steps=2)
    mine = export_model_state_dict(sim["state"], SimulatedWorld(mc.W, groups=moe.expert_groups(mc.W, mc.EP)))
    assert all(torch.equal(mine[k], whole[k]) for k in whole)
    for world, ep in [(4, 4), (2, None)]:
        comm = SimulatedWorld(world, groups=moe.expert_groups(world, ep)) if ep else SimulatedWorld(world)
        m = mc.model("mixtral")
        groups = {moe.EXPERTS: moe.expert_parallel(m, comm)} if ep else None
        template = fzero.init_train_state(m, fzero.sgd(lr=0.5, momentum=0.9), comm, groups=groups)
        state, _ = load_checkpoint(got[0]["path"], template, comm)
        loaded = export_model_state_dict(state, comm)
        assert all(torch.equal(loaded[k], whole[k]) for k in whole), (world, ep)


def test_ranks_giving_other_groups_are_named_on_every_rank(gloo):
    for rank in range(mc.W):
        message = gloo[rank]["disagree"]["message"]
        assert message is not None and "ranks [1, 2, 3] gave other parameter groups than rank 0" in message, message
