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
    return run_torchrun(mc.W, "moe_worker.py", list(CASES), timeout=300)


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
