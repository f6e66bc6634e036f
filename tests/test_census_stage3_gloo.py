"""Stage 3's eager step on real gloo ranks against ``memory_report``: the gathered parameters
(``fzero::gather``), the gradient reductions (``fzero::grad_reduction``) and both together
(``step_peak``), as the census finds them on each rank (``census_stage3_worker.py``).

A real rank's step differs from the simulated world's: each unit call's gather carries the
call-check tag, and in backward a unit's reduction and the gather of the unit two before it
travel in one all-to-all (``TorchCommunicator.batched``). The prediction replays that
(:func:`fzero.memory._replay_stage3_rank`). What it leaves out, and the test allows for: the
0-d scalars of an fp32 average (12 bytes each), within ``SLACK``; and what the census could
not see freed (a buffer whose last reference gloo's worker thread dropped after the wait is
freed where the profiler does not look: the census keeps it live to the end of the step)."""

from __future__ import annotations

import pytest

from dist_harness import run_torchrun
from fzero.scopes import GATHER, GRAD_REDUCTION
from test_distributed import _case

pytestmark = pytest.mark.distributed

SLACK = 256  # bytes the prediction leaves out (module doc)
CASES = ["mlp fp32", "mlp bf16", "mlp bf16 compute", "gpt2"]


@pytest.fixture(scope="module", params=[2, 3], ids=["w2", "w3"])
def ranks(request):
    pytest.importorskip("transformers")
    return request.param, run_torchrun(request.param, "census_stage3_worker.py", CASES, timeout=300)


@pytest.mark.parametrize("case", CASES)
def test_gloo_stage3_step_buffers_as_memory_report_predicts(ranks, case):
    world, results = ranks
    for r, got in enumerate(_case(results, case)):
        census, predicted, unseen = got["census"], got["predicted"], got["unseen"]
        print(f"\nW={world} rank {r} {case}: census {census}\n{'':>{len(case) + 12}}predicted {predicted}")
        for k in (GATHER, GRAD_REDUCTION, "together"):
            assert predicted[k] is not None, (r, k)
            assert 0 <= census[k] - predicted[k] <= unseen[k] + SLACK, (world, r, case, k, got)
