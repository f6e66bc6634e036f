"""Parameter groups on four gloo ranks (``param_group_worker.py``: ``TorchCommunicator(groups=...)``, a process group
per rank group) against the simulated world of ``test_param_groups.py``: bitwise the same parameters, losses, norms,
sat-out counts and bytes per axis at stages 1-3, and named errors for wrong groups before any collective."""

from __future__ import annotations

import pytest
import torch

import param_group_cases as pc
from dist_harness import run_torchrun
from fzero.comm import CountingCommunicator, SimulatedWorld
from helpers import CHEAP_COMPILE
from param_group_worker import CASES

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gloo():
    return run_torchrun(4, "param_group_worker.py", [*CASES, "wrong"], timeout=300)


def _result(gloo, rank: int, case: str) -> dict:
    got = gloo[rank][case]
    assert "exception" not in got, got.get("exception")
    return got


@pytest.mark.parametrize("case", list(CASES))
def test_gloo_groups_equal_the_simulated_world_bitwise(gloo, case):
    """Also compiled (the masked model in one graph; fzero's traced gloo operators on each group's process group)."""
    stage, clip, accum, opt, starve, compiled = CASES[case]
    counter = CountingCommunicator(SimulatedWorld(4, groups=pc.GROUPS))
    sim = pc.run_fzero(counter.inner, stage, clip, accum, starve=starve, opt=opt, counter=counter, masked=compiled,
                       compile=CHEAP_COMPILE if compiled else False)
    for rank in range(4):
        got = _result(gloo, rank, case)
        assert "group 'experts': 2 of 2 ranks" in got["repr"]
        for name, value in sim["params"][rank].items():
            assert torch.equal(value, got["params"][name]), (rank, case, name)
        assert sim["losses"] == got["losses"] and sim["norms"] == got["norms"]
        assert torch.equal(sim["state"].opt.missed[0], got["missed"])
        if stage < 3 and not compiled:  # compiled: counted once, while tracing; stage 3: every simulated rank's run gathers all rows, and real ranks gather unit-call tags
            for axis in ("shard", "experts"):
                assert sum(b for _, a, _, b in got["records"] if a == axis) == counter.totals(axis=axis)["bytes"]


def test_gloo_wrong_groups_are_named_before_any_collective(gloo):
    for rank in range(4):
        messages = _result(gloo, rank, "wrong")["messages"]
        assert "groups['experts']: mesh (3, 2)" in messages[0]
        assert "rank 1 is in two rank groups" in messages[1]
        assert "a parameter group's name must be a non-empty string" in messages[2]
