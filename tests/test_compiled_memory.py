"""Compiled steps' memory on gloo W=2: stage 3 holds the root and a couple of units, not the
whole model; stages 1-2 reduce one flat group at a time.

Under ``torch.compile`` each unit's bucket is gathered in the unit's forward and gathered again
in backward (selective recomputation, fzero.units.CompiledUnits) and reduced in backward. One
torchrun of 2 gloo ranks runs one donating compiled stage-3 step on a model of 12 units of
4 MiB and a root of a few kB and reads the peak RSS above the RSS before the step
(``dist_cases.stage3_step_memory``): holding every unit would take 12 units on top of the
gradient shards; the bound is the shards, the root and three units (the unit regathered, its
gradient, the reduce-scatter's received buffer) and 2 MiB. Measured: 31.9 MiB (24.1 of shards,
units of 4.0 MiB, all units 48.1); the former path (every unit gathered at once) 54.2 MiB.

The same launch counts with the census the gathered parameters live at once on a
``transformers`` GPT-2 (``dist_cases.stage3_gather_schedule``): the root and one unit (inductor's
own reordering had moved every gather ahead of the forward: the root and every unit twice,
until ``fzero.compiled`` turned it off for a regathering graph). And the census of compiled
donating stage-1 and -2 fp32 steps (``dist_cases.compiled_reduction_census``, MLPs of six flat
groups, reduced group by group and joined): the reductions hold the shards so far and one
group's received buffer, no more (before gloo's operators every group's received buffer, or at
stage 1 every group's whole sum, was live at once: 33.06 MiB against 27.03 now). The census
counts a buffer whose last reference gloo's thread drops until its address is reused
(``unseen``).
"""

from __future__ import annotations

import pytest

from dist_harness import run_torchrun
from test_distributed import _case

pytestmark = pytest.mark.distributed

MIB = 2**20


CENSUS = ["compiled_reduction_census=1024x2048x1024x1536", "compiled_reduction_census=512x1024x512x768x256",
          "compiled_reduction_census=1024x2048x1024x1536,1"]


@pytest.fixture(scope="module")
def peaks():
    return run_torchrun(2, "dist_worker.py", ["stage3_memory_compiled", "stage3_gather_schedule", *CENSUS],
                        timeout=600)


def test_compiled_stage3_step_holds_the_root_and_a_few_units(peaks):
    for r, got in enumerate(_case(peaks, "stage3_memory_compiled")):
        bound = got["grad_shards"] + got["root"] + 3 * got["unit"] + 2 * MIB
        assert got["peak"] <= bound, (r, {k: v / MIB for k, v in got.items()}, bound / MIB)
        assert got["peak"] < got["units"], (r, got)  # clearly below every unit held at once


def test_compiled_stage3_gathers_the_root_and_at_most_two_units_at_once(peaks):
    for r, got in enumerate(_case(peaks, "stage3_gather_schedule")):
        at = (r, {k: v / MIB for k, v in got.items()})
        assert got["units"] >= 4 * got["unit"], at  # four blocks: holding them all would show
        assert got["gathered"] <= got["root"] + 2 * got["unit"], at
        # the shards reduced so far beside one group's received buffer
        assert got["reduction"] - got["unseen reduction"] <= got["shards"] + got["largest group"], at


@pytest.mark.parametrize("case", CENSUS, ids=["group by group", "joined", "stage 1"])
def test_compiled_reductions_hold_one_group_at_a_time(peaks, case):
    for r, got in enumerate(_case(peaks, case)):
        at = (r, {k: v / MIB for k, v in got.items()})
        assert got["groups"] == 6, at
        # what the census sees is the truth plus buffers freed on gloo's thread, never less
        assert got["reduction"] - got["unseen"] <= (got["shards"] + got["largest group"]) * 1.05, at
        assert got["shards"] <= got["reduction"], at
