"""Compiled stage 3 holds the root and a couple of units, not the whole model (gloo W=2).

Under ``torch.compile`` each unit's bucket is gathered in the unit's forward and gathered
again in backward (selective recomputation of the all-gathers, fzero.units.CompiledUnits),
and reduced in backward. One torchrun of 2 gloo ranks (its own processes: the case sets
glibc's mmap threshold) runs one donating compiled stage-3 step on a model of 12
units of 4 MiB and a root of a few kB, and reads the peak RSS above the RSS just before the
step (tests/dist_cases.py ``stage3_step_memory``). Holding every unit would take 12 units on
top of the gradient shards; the bound is the shards, the root and three units (the unit being
regathered, its full gradient, the reduce-scatter's received buffer) and 2 MiB of slack.
Measured: 31.9 MiB (24.1 MiB of gradient shards, units of 4.0 MiB, all units 48.1 MiB); the
former compiled path (every unit gathered at once, kept to its backward) took 54.2 MiB.

The same launch counts the gathered parameters live at once with the census on a
``transformers`` GPT-2 (``dist_cases.stage3_gather_schedule``): at most the root and two units.
There inductor's reordering passes had moved every unit's gathers, the forward's and the
backward's regathers, ahead of the forward's compute: 44.0 MiB live at once, the root (7.9)
and every unit (18.1) twice; with the passes off for a regathering graph (``fzero.compiled``),
10.9: the root and one unit.
"""

from __future__ import annotations

import pytest

from dist_harness import run_torchrun
from test_distributed import _case

pytestmark = pytest.mark.distributed

MIB = 2**20


@pytest.fixture(scope="module")
def peaks():
    return run_torchrun(2, "dist_worker.py", ["stage3_memory_compiled", "stage3_gather_schedule"], timeout=600)


def test_compiled_stage3_step_holds_the_root_and_a_few_units(peaks):
    for r, got in enumerate(_case(peaks, "stage3_memory_compiled")):
        bound = got["grad_shards"] + got["root"] + 3 * got["unit"] + 2 * MIB
        assert got["peak"] <= bound, (r, {k: v / MIB for k, v in got.items()}, bound / MIB)
        assert got["peak"] < got["units"], (r, got)  # clearly below every unit held at once


def test_compiled_stage3_gathers_the_root_and_at_most_two_units_at_once(peaks):
    for r, got in enumerate(_case(peaks, "stage3_gather_schedule")):
        assert got["units"] >= 6 * got["unit"], got  # six blocks: holding them all would show
        assert got["gathered"] <= got["root"] + 2 * got["unit"], (r, {k: v / MIB for k, v in got.items()})
